"""LoRA / QLoRA in the estimator: one builder (memlab.estimate.adapters), one answer by the API, the CLI and plan;
the fake trace equals the real step; bad adapter values are errors; the peers' formulas; aliases."""
from __future__ import annotations

import re
import shlex

import pytest

from memlab.estimate import adapters as A
from memlab import estimate as E
from memlab.cli import estimate as estimate_cli
from memlab.estimate import peers
from memlab import plan as P

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=512)
SMALL3 = {**SMALL, "num_hidden_layers": 3}  # traced whole (one trace per route: kept fast)


def _cli_peak(argv, capsys) -> int:
    assert estimate_cli.main(argv) == 0
    out = capsys.readouterr().out
    return int(re.search(r"peak: ([\d,]+) bytes of tensors", out).group(1).replace(",", ""))


def _set_args(overrides):
    out = []
    for k, v in overrides.items():
        out += ["--set", f"{k}={v}"]
    return out


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_api_cli_and_plan_agree_to_the_byte(adapter, capsys):
    api = E.estimate_training_memory("llama-2-7b", config_overrides=SMALL3, batch_size=2, seq_len=32, dtype="bf16",
                                     adapter=adapter, lora_r=8)
    cli = _cli_peak(["llama-2-7b", *_set_args(SMALL3), "--batch-size", "2", "--seq-len", "32", "--adapter", adapter,
                     "--lora-r", "8"], capsys)
    stack = P.Stack(precision="bf16-mixed", adapter=adapter, micro_batch=2)
    planned = P.estimate_stack("llama-2-7b", stack, seq_len=32, config_overrides=SMALL3, lora_r=8)
    assert api.peak_bytes == cli == planned.peak_bytes
    assert api.breakdown == planned.breakdown and api.phase_peaks == planned.phase_peaks
    assert api.breakdown["gradients"] < api.breakdown["parameters"] / 10
    assert adapter in api.adapter and any("memlab.estimate.adapters" in n for n in api.notes)


def test_adapter_extrapolation_equals_the_full_trace():
    seven = {**SMALL, "num_hidden_layers": 7}
    api = E.estimate_training_memory("llama-2-7b", config_overrides=seven, batch_size=2, seq_len=32, dtype="bf16",
                                     adapter="qlora", lora_r=8)
    assert api.extrapolated_from == (3, 4)  # a frozen embedding: the first layer differs; traced at 3, 4 and 5
    full = E.estimate_training_memory("llama-2-7b", config_overrides=seven, batch_size=2, seq_len=32, dtype="bf16",
                                      adapter="qlora", lora_r=8, extrapolate=False)
    assert full.peak_bytes == api.peak_bytes and full.breakdown == api.breakdown


def _tiny():
    from memlab.models import tiny_llama

    return tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2)


@pytest.mark.parametrize("kw", [dict(adapter="lora", lora_r=4, target_modules="q_proj,v_proj", lora_dropout=0.1),
                                dict(adapter="qlora", lora_r=4),
                                dict(adapter="lora", lora_r=4, adapter_dtype="bf16", dtype="bf16-pure")])
def test_fake_trace_equals_real_step(kw):
    kw = {"dtype": "bf16", **kw}
    fake = E.estimate_training_memory(_tiny, batch_size=2, seq_len=16, device="cpu", kernel_scratch=False, **kw)
    real = E.measure_training_memory(_tiny, batch_size=2, seq_len=16, device="cpu", **kw)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.breakdown == real.breakdown


def test_adapter_settings_change_the_answer():
    base = dict(batch_size=2, seq_len=16, device="cpu")
    few = E.estimate_training_memory(_tiny, adapter="lora", target_modules="q_proj", **base)
    many = E.estimate_training_memory(_tiny, adapter="lora", **base)
    assert few.breakdown["optimizer"] < many.breakdown["optimizer"]
    r8 = E.estimate_training_memory(_tiny, adapter="lora", lora_r=8, **base)
    # the moments are linear in the rank; each of the 28 adapter tensors has a 4-byte step counter besides
    assert 2 * r8.breakdown["optimizer"] - many.breakdown["optimizer"] == 28 * 4
    drop = E.estimate_training_memory(_tiny, adapter="lora", lora_dropout=0.1, **base)
    assert drop.max_activation_bytes > many.max_activation_bytes  # the dropout masks
    b16 = E.estimate_training_memory(_tiny, adapter="lora", adapter_dtype="bf16", **base)
    assert 2 * b16.breakdown["optimizer"] - many.breakdown["optimizer"] == 28 * 4  # bf16 moments, fp32 counters


@pytest.mark.parametrize("kw,needle", [
    (dict(adapter="dora"), "adapter='dora' is invalid; allowed: None, 'lora', 'qlora'"),
    (dict(adapter="lora", lora_r=0), "lora_r=0 is invalid; allowed: an int "),
    (dict(adapter="lora", lora_dropout=1.5), "lora_dropout=1.5 is invalid; allowed: a "),
    (dict(adapter="lora", lora_alpha=-1), "lora_alpha=-1 is invalid"),
    (dict(adapter="lora", adapter_dtype="int8"), "adapter_dtype='int8' is invalid; allowed: 'fp32', 'bf16', 'fp16'"),
    (dict(adapter="lora", target_modules="nope_proj"), "target_modules='nope_proj' matches no linear layer"),
    (dict(lora_r=8), "lora_r=8 given without an adapter"),
])
def test_bad_adapter_values(kw, needle):
    with pytest.raises(ValueError) as exc:
        E.estimate_training_memory(_tiny, batch_size=1, seq_len=8, device="cpu", **kw)
    assert needle in str(exc.value)


def test_cli_bad_adapter_value(capsys):
    code = estimate_cli.main(["llama-2-7b", *_set_args(SMALL), "--seq-len", "8", "--adapter", "lora", "--target-modules", "wq"])
    err = capsys.readouterr().err
    assert code == 2 and "target_modules='wq' matches no linear layer" in err and "q_proj" in err


def test_suggestion_commands_reproduce_their_rows(capsys):
    # a base with nothing else to try (checkpointing with offloaded inputs, the fused loss, the optimizer in
    # backward, 8-bit AdamW, pure bf16, batch 1, one token): the traced rows are LoRA and QLoRA only (kept fast)
    chapter09 = dict(loss="fused", offload_checkpoints=True, optimizer_in_backward=True)
    kw = dict(config_overrides=SMALL3, batch_size=1, seq_len=1, dtype="bf16-pure", optimizer="adamw8bit",
              checkpointing=True, **chapter09)
    base = E.estimate_training_memory("llama-2-7b", **kw)
    rows = E.suggestions(base, "llama-2-7b", config_overrides=SMALL3, **chapter09)
    traced = [s for s in rows if s.how == "traced"]
    assert [s.technique.split()[0] for s in traced] == ["LoRA", "QLoRA"]
    assert "--adapter lora" in traced[0].command and "--adapter qlora" in traced[1].command
    assert all(f in traced[1].command for f in ("--loss fused", "--offload-checkpoints", "--optimizer-in-backward"))
    assert _cli_peak(shlex.split(traced[1].command)[2:], capsys) == traced[1].peak_bytes


def test_peers_formulas():
    assert peers.bytes_per_param_rule(10**9, "bf16", "adamw") == 18 * 10**9
    assert peers.bytes_per_param_rule(10**9, "fp32", "adamw") == 16 * 10**9
    assert peers.bytes_per_param_rule(10**9, "bf16", "adam8bit") == 12 * 10**9
    assert peers.bytes_per_param_rule(10**9, "bf16-pure", "adamw") == 8 * 10**9
    with pytest.raises(ValueError, match="dtype='fp8' is invalid"):
        peers.bytes_per_param_rule(1, "fp8")
    est = E.estimate_training_memory("llama-2-7b", config_overrides=SMALL3, batch_size=2, seq_len=32)
    rows = peers.compare(est)
    assert [r["tool"] for r in rows][1:] == ["accelerate estimate-memory", "DeepSpeed ZeRO estimator",
                                             "bytes-per-parameter rule"]
    P_ = est.n_params
    assert rows[1]["bytes"] == 8 * P_ and rows[2]["bytes"] == 20 * P_ and rows[3]["bytes"] == 18 * P_
    assert rows[0]["bytes"] == est.allocated_bytes


def test_cli_compare(capsys):
    assert estimate_cli.main(["llama-2-7b", *_set_args(SMALL3), "--seq-len", "32", "--compare"]) == 0
    out = capsys.readouterr().out
    for needle in ("accelerate estimate-memory", "DeepSpeed ZeRO estimator", "bytes-per-parameter rule",
                   peers.ANATOMY_URL, peers.DEEPSPEED_URL, "what they leave out"):
        assert needle in out


def test_optimizer_and_dtype_aliases():
    a = E.estimate_training_memory(_tiny, batch_size=1, seq_len=8, device="cpu", optimizer="adam8bit")
    b = E.estimate_training_memory(_tiny, batch_size=1, seq_len=8, device="cpu", optimizer="adamw8bit")
    assert a.optimizer == "adamw8bit" and a.peak_bytes == b.peak_bytes
    c = E.estimate_training_memory(_tiny, batch_size=1, seq_len=8, device="cpu", dtype="bf16-mixed")
    d = E.estimate_training_memory(_tiny, batch_size=1, seq_len=8, device="cpu", dtype="bf16")
    assert c.dtype == d.dtype == "bf16-mixed" and c.peak_bytes == d.peak_bytes  # one vocabulary: bf16 = bf16-mixed


def test_adapter_spec_cli_args_round_trip():
    spec = A.adapter_spec("qlora", lora_r=4, lora_alpha=8, target_modules="q_proj,v_proj", lora_dropout=0.05)
    assert spec.cli_args() == ["--adapter", "qlora", "--lora-r", "4", "--lora-alpha", "8", "--target-modules",
                               "q_proj,v_proj", "--lora-dropout", "0.05", "--adapter-dtype", "fp32"]
    assert A.adapter_spec(None) is None and A.adapter_spec(spec) is spec
