"""memlab estimate --validate: published figures, each with its source, settings and metric; offline.

``test_validation_meets_the_targets`` runs the whole validation (every figure traced on fake tensors,
a few minutes on 2 busy CPU cores) and asserts issue 21's definition of done: at least 15 comparable
figures, every allocated figure within 3% and their median within 2%, every reserved / nvidia-smi /
unstated figure at or above the estimate, except the known undecided rows (a length the source did not
record), each with the longest batch at which it would be met. The other tests check each figure's documentation, the
verdict logic and the command's output on the two single-GPU Mistral-7B figures.
"""
from __future__ import annotations

import re
import statistics

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memlab import estimate as E
from memlab.cli import estimate as estimate_cli
from memlab.estimate import validate as PP
from memlab.core.units import GiB

# The rows whose source records only an upper bound on the padded length and whose estimate is above the reserved
# figure at that bound (validate: PEFT's four LoRA runs, which share one unrecorded longest batch). A row that
# joins or leaves this set is a change of the estimator's numbers: look at why before updating it.
# The rows that miss their target for the reason their `off` states (torchtune's compiled runs, and its own Llama
# against transformers'): printed with how far off they are, counted apart, never as met.
KNOWN_OFF = {"torchtune optimization flags: + Packed Dataset, Llama 3.2 3B, batch 2 x 4096",
             "torchtune optimization flags: + Chunked Cross Entropy, Llama 3.2 3B, batch 2 x 4096",
             "torchtune optimization flags: + Fuse optimizer step into backward, Llama 3.2 3B, batch 2 x 4096"}
# litgpt's own GPT against transformers' (issue 38, point 2): with Lightning Fabric's fp32 outputs traced, litgpt's own
# model (tools/trace_litgpt.py) meets every row; transformers' model of the same dimensions misses these by more than
# 3% for the per-layer differences their `off` states
LITGPT_OFF = {"litgpt config_hub on A10G: tiny-llama/lora.yaml, LoRA r32 on every projection and the head, "
              "TinyLlama-1.1B, micro-batch 8",
              "litgpt config_hub on A10G: tiny-llama/full.yaml, full fine-tuning, TinyLlama-1.1B, micro-batch 4",
              "litgpt config_hub on A10G: llama-2-7b/lora.yaml, LoRA r32 on q and v, Llama-2-7B, micro-batch 2",
              "litgpt config_hub on A10G: phi-2/lora.yaml, LoRA r8 on every projection and the head, Phi-2, micro-batch 4"}
TORCHTUNE_OFF = set(KNOWN_OFF)
KNOWN_OFF = TORCHTUNE_OFF | LITGPT_OFF
KNOWN_UNDECIDED = {"PEFT MetaMathQA: LoRA r32 q,v, Llama-3.2-3B", "PEFT MetaMathQA: LoRA r64 q,v, Llama-3.2-3B",
                   "PEFT MetaMathQA: rsLoRA r64 q,v, Llama-3.2-3B", "PEFT MetaMathQA: LoRA r10 MLP, Llama-3.2-3B"}


def test_figures_are_documented():
    assert len(PP.FIGURES) >= 15 and len(PP.NOT_EXPRESSIBLE) >= 8
    assert {f.kind for f in PP.FIGURES} >= {"full", "lora"}
    assert {f.model for f in PP.FIGURES if isinstance(f.model, str)} >= {"mistral-7b", "bert-large-cls"}
    assert any(f.settings.get("world_size", 1) > 1 for f in PP.FIGURES)  # a sharded (FSDP) run
    assert {f.settings["dtype"] for f in PP.FIGURES} >= {"fp32", "fp16", "bf16-pure"}
    assert {f.settings["optimizer"] for f in PP.FIGURES} >= {"adamw", "adamw8bit"}
    assert sum(f.metric == "allocated" for f in PP.FIGURES) >= 4
    for f in PP.FIGURES:
        assert f.source.startswith("https://") and f.metric in PP.METRICS
        assert f.measured_bytes > GiB and f.as_published and f.gpu and f.differs
        assert {"batch_size", "seq_len", "dtype", "optimizer"} <= set(f.settings)
        assert (f.context_bytes > 0) == (f.metric == "nvidia-smi")  # the context named where it is in the figure
    assert len({f.name for f in PP.FIGURES} | {n for n, *_ in PP.NOT_EXPRESSIBLE}) == \
        len(PP.FIGURES) + len(PP.NOT_EXPRESSIBLE)
    for name, url, published, why in PP.NOT_EXPRESSIBLE:
        assert url.startswith("https://") and published and why
    whys = [why for *_, why in PP.NOT_EXPRESSIBLE]
    assert any("FSDP1" in why for why in whys) and any("Adafactor" in why for why in whys)
    assert any("paged" in why.lower() and "optimizer_in_bwd" in why for why in whys)
    assert KNOWN_UNDECIDED <= {f.name for f in PP.FIGURES if f.length_cap}
    # chapter 09's loss: published rows with the chunked loss, beside the plain loss's row of the same run
    chunked = [f for f in PP.FIGURES if f.settings.get("loss") in ("chunked", "fused")]
    assert len(chunked) >= 2 and all(
        any(g.source == f.source and g.settings.get("loss", "auto") in ("auto", "hf") for g in PP.FIGURES) for f in chunked)
    assert KNOWN_OFF <= {f.name for f in PP.FIGURES if f.off}


def test_the_chunked_loss_rows_meet_their_target_or_say_how_far_off_and_why(capsys):
    rows = {r["figure"].name: r for r in PP.validate("torchtune optimization flags")}
    assert len(rows) == 4 and set(rows) > TORCHTUNE_OFF
    (met,) = [r for name, r in rows.items() if name not in TORCHTUNE_OFF]
    assert met["ok"] is True and met["figure"].settings["loss"] == "chunked" and abs(met["error"]) <= 0.03
    for name in TORCHTUNE_OFF:
        r = rows[name]
        assert r["explained"] and r["ok"] is False and abs(r["error"]) > 0.03
    # the compiled run with the chunked loss is over the figure (compile shrinks what eager PyTorch keeps), the eager
    # plain loss under it; and the chunked loss lowers the estimate of the same run
    plain = rows["torchtune optimization flags: + Packed Dataset, Llama 3.2 3B, batch 2 x 4096"]
    ce = rows["torchtune optimization flags: + Chunked Cross Entropy, Llama 3.2 3B, batch 2 x 4096"]
    assert plain["error"] < 0 < ce["error"] and ce["compared_bytes"] < plain["compared_bytes"]
    sm = PP.summary(list(rows.values()))
    assert sm["failed"] == [] and set(sm["explained"]) == TORCHTUNE_OFF and sm["allocated_n"] == 1
    PP.main("torchtune optimization flags")
    out = capsys.readouterr().out
    assert "1 of 4 comparable figures meet their target; 3 off for a stated reason" in out
    assert out.count("explained: torch.compile") == 2 and "chunked loss" in out and "MISSED" not in out


@pytest.mark.parametrize("metric,ours,ok", [("allocated", 103, True), ("allocated", 96, False),
                                            ("allocated", 97, True), ("allocated", 104, False),
                                            ("reserved", 100, True), ("reserved", 101, False),
                                            ("nvidia-smi", 99, True), ("nvidia-smi", 101, False),
                                            ("unstated", 120, False)])
def test_verdicts(metric, ours, ok):
    fig = PP.Figure(name="x", source="https://x", measured_bytes=100, metric=metric, as_published="x", model="x")
    assert PP._verdict(fig, ours)[1] is ok


@pytest.mark.parametrize("metric,ours,ok", [("reserved", 100, True), ("reserved", 101, None),
                                            ("allocated", 104, False), ("allocated", 97, True)])
def test_verdicts_with_only_a_length_cap(metric, ours, ok):
    """At or below a reserved figure at the cap is met at any shorter length; above it is undecided (a shorter
    longest batch may explain it); an allocated figure is two-sided and never capped this way."""
    fig = PP.Figure(name="x", source="https://x", measured_bytes=100, metric=metric, as_published="x", model="x",
                    length_cap=True)
    assert PP._verdict(fig, ours)[1] is ok


def test_peft_step_keeps_what_the_loop_keeps(monkeypatch):
    """PEFT's loop against the estimator's default step on the same small model: the padded batch's mask path
    and the outputs kept through backward add bytes; and the bisection of an undecided row finds the longest
    length whose estimate is at or below a figure placed exactly at one length's estimate."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, head_dim=16, max_position_embeddings=256)
    kw = dict(batch_size=2, seq_len=64, dtype="bf16-pure", optimizer="adamw", device="cuda", gpu="l40s")
    plain = E.estimate_training_memory(cfg, **kw)
    peft = E.estimate_training_memory(cfg, step=PP._peft_step, **kw)
    assert peft.peak_bytes >= plain.peak_bytes + 2 * 64 * 512 * 2  # at least the bf16 logits `outputs` keeps
    assert "padding mask" in peft.attention and "padding mask" not in plain.attention
    at = {n: E.estimate_training_memory(cfg, step=PP._peft_step, **{**kw, "seq_len": n}).allocated_bytes
          for n in (40, 41)}
    assert at[41] > at[40]
    settings = {k: v for k, v in kw.items() if k not in ("device", "gpu")}
    fig = PP.Figure(name="x", source="https://x", measured_bytes=at[40], metric="reserved", as_published="x",
                    model="small", settings={**settings, "step": PP._peft_step}, card="l40s", length_cap=True)
    monkeypatch.setattr(PP, "_model", lambda f: (cfg, {}))
    assert PP._verdict(fig, peft.allocated_bytes)[1] is None  # above the figure at the cap: undecided
    assert PP._longest_length_at_or_below(fig) == (40, at[40], at[41])
    low = PP.Figure(**{**fig.__dict__, "measured_bytes": 1})
    assert PP._longest_length_at_or_below(low) is None  # above at any length: a miss, not undecided


def test_validate_mistral_rows_within_target(capsys):
    assert estimate_cli.main(["--validate", "acceleration: full fine-tuning, Mistral-7B"]) == 0  # the 2 single-GPU rows
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("fms-acceleration: full fine-tuning, Mistral-7B")]
    assert len(rows) == 2 and all("met (within 3%)" in r for r in rows)
    assert "allocated figures: median |error|" in out and "2 of 2 comparable figures meet their target" in out
    assert PP._FMS in out and "MISSED" not in out
    # the filter names no row that cannot be expressed: none is counted or listed
    assert "0 published figures the estimator cannot express are listed" in out


def test_validate_filter_counts_only_its_not_expressible_rows(capsys):
    assert estimate_cli.main(["--validate", "QLoRA"]) == 0  # no comparable QLoRA row; four that cannot be expressed
    out = capsys.readouterr().out
    qlora = [n for n, *_ in PP.NOT_EXPRESSIBLE if "qlora" in n.lower()]
    assert len(qlora) >= 4  # fms-acceleration's two, Answer.AI's FSDP-QLoRA, Qwen's GPTQ Q-LoRA
    assert f"{len(qlora)} published figures the estimator cannot express are listed" in out
    assert out.count("cannot express: ") == len(qlora) and "DoRA" not in out


@pytest.fixture(scope="module")
def all_rows():
    return PP.validate()


@pytest.mark.slow
def test_validation_meets_the_targets(all_rows, capsys):
    rows = all_rows
    assert len(rows) == len(PP.FIGURES) >= 15
    alloc = [r for r in rows if r["figure"].metric == "allocated" and r["figure"].name not in KNOWN_OFF]
    errors = {r["figure"].name: r["error"] for r in alloc}
    off = {r["figure"].name for r in rows if r["explained"]}
    assert off == KNOWN_OFF and all(r["ok"] is False and r["figure"].off for r in rows if r["explained"])
    assert len(alloc) >= 4 and all(abs(e) <= 0.03 for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) <= 0.02, errors
    above = {r["figure"].name: r["error"] for r in rows if r["figure"].metric != "allocated"
             and r["compared_bytes"] > r["figure"].measured_bytes}
    undecided = {r["figure"].name for r in rows if r["ok"] is None}
    assert set(above) == undecided == KNOWN_UNDECIDED, above  # no reserved figure is missed at any length
    assert sum(r["ok"] is True for r in rows) >= 15 and not any(r["ok"] is False and not r["explained"] for r in rows)
    for r in rows:
        if r["ok"] is None:  # the longest length whose estimate is at or below the figure, and one token more above
            n, below, over = r["longest"]
            assert 1 <= n < r["figure"].settings["seq_len"] and below <= r["figure"].measured_bytes < over
    for r in rows:  # the nvidia-smi rows carry the source's CUDA context on top of the allocated estimate
        f = r["figure"]
        assert r["compared_bytes"] == r["estimate"].allocated_bytes + (f.context_bytes if f.metric == "nvidia-smi" else 0)
    sm = PP.summary(rows)
    assert not sm["failed"] and set(sm["undecided"]) == KNOWN_UNDECIDED and sm["n"] == len(rows) - len(KNOWN_UNDECIDED)
    assert set(sm["explained"]) == KNOWN_OFF
    PP.main()  # the cached rows: prints without tracing again
    out = capsys.readouterr().out
    met = sm["n"] - len(KNOWN_OFF)
    assert f"{met} of {sm['n']} comparable figures meet their target; {len(KNOWN_OFF)} off for a stated reason" in out
    assert "MISSED" not in out and out.count("explained: ") == len(KNOWN_OFF)
    assert f"{len(KNOWN_UNDECIDED)} undecided (the source records only an upper bound" in out
    assert out.count("undecided: at or below it for a longest batch of at most") == len(KNOWN_UNDECIDED)
    assert out.count("undecided (met for a longest batch of <= ") == len(KNOWN_UNDECIDED)
    assert f"{len(PP.NOT_EXPRESSIBLE)} published figures the estimator cannot express" in out
    # the caching-allocator model's prediction beside every reserved / nvidia-smi / unstated figure, from the
    # estimate's own reserved_bytes (the replay), with the source's context where the figure includes one
    resv = [r for r in rows if r["figure"].metric != "allocated"]
    for r in rows:
        f, est = r["figure"], r["estimate"]
        if f.metric == "allocated":
            assert r["reserved_bytes"] is None and r["reserved_error"] is None
            continue
        assert est.reserved_replay_bytes is not None and est.reserved_bytes >= est.allocated_bytes
        assert r["reserved_bytes"] == est.reserved_bytes + (f.context_bytes if f.metric == "nvidia-smi" else 0)
        assert r["reserved_error"] == pytest.approx(r["reserved_bytes"] / f.measured_bytes - 1)
    assert out.count("   caching-allocator model: ") == len(resv)
    errs = [abs(r["reserved_error"]) for r in resv]
    assert (f"caching-allocator model on the {len(resv)} reserved / nvidia-smi / unstated figures: median |error| "
            f"{100 * statistics.median(errs):.1f}%, worst {100 * max(errs):.1f}%, "
            f"{sum(e <= 0.05 for e in errs)} of {len(resv)} within 5%") in out


def test_litgpt_rows_trace_litgpt_loop_and_untied_head():
    """litgpt's table (A10G): the rows trace litgpt's loss on Fabric's fp32 logits and the untied head; Gemma-2B's
    LoRA row (every projection and the head) and Mistral's (q, v) meet their figures, the rows of LITGPT_OFF say why
    they miss theirs."""
    rows = {r["figure"].name: r for r in PP.validate("litgpt config_hub")}
    assert len(rows) == 6 and set(rows) > LITGPT_OFF
    for r in rows.values():
        f = r["figure"]
        if isinstance(f.model, tuple):  # litgpt's head is a tensor of its own (presets llama-2-7b, mistral-7b: untied)
            assert f.model[1]["tie_word_embeddings"] is False
        assert f.settings["step"] in (PP._litgpt_step, PP._litgpt_full_step)
        assert f.metric == "allocated" and f.measured_bytes % 10_000_000 == 0  # printed in GB of 1e9 bytes
    met = [r for name, r in rows.items() if name not in LITGPT_OFF]
    assert len(met) == 2 and all(r["ok"] is True and abs(r["error"]) <= 0.03 for r in met)
    assert {r["figure"].settings["target_modules"] for r in met} == {PP._ALL_HEAD, "q_proj,v_proj"}
    for name in LITGPT_OFF:
        assert rows[name]["explained"] and abs(rows[name]["error"]) > 0.03
    qlora = [n for n, *_ in PP.NOT_EXPRESSIBLE if n.startswith("litgpt config_hub") and "QLoRA" in n]
    assert len(qlora) == 3


def _stored_litgpt_trace() -> dict[str, tuple[str, ...]]:
    from pathlib import Path

    stored = (Path(__file__).resolve().parents[2] / "results/cpu/litgpt_own_model.txt").read_text()
    assert stored.startswith("litgpt's own GPT and LoRA (commit bc3c337f)")
    return {m[1]: (m[2], m[3] + "%", m[4], m[5] + "%") for m in re.finditer(
        r"^(\S+\.yaml)\s+[\d.]+ GB\s+([\d.]+) GB\s+([+-][\d.]+)%\s+([\d.]+) GB\s+([+-][\d.]+)%", stored, re.M)}


def test_the_litgpt_rows_quote_the_stored_trace_of_litgpts_own_model():
    """The litgpt rows quote tools/trace_litgpt.py's estimates of litgpt's own GPT and LoRA (litgpt is no
    dependency: the stored output is the record), each figure as stored; with Fabric's fp32 outputs every row is
    within 3% of its figure, and without them (the model's bf16 logits) the rows adapting the head are not."""
    traced = _stored_litgpt_trace()
    assert traced == PP._LITGPT_OWN_TRACED and len(traced) == 6
    figs = [f for f in PP.FIGURES if f.name.startswith("litgpt config_hub")]
    assert len(figs) == 6
    for f in figs:
        cfg = f.name.split(": ", 1)[1].split(", ")[0]
        assert PP._litgpt_own(cfg) in f.off + f.differs
        assert abs(float(traced[cfg][1][:-1])) <= 3.0
    assert sum(abs(float(t[3][:-1])) > 3.0 for t in traced.values()) == 3
    from pathlib import Path

    stored = (Path(__file__).resolve().parents[2] / "results/cpu/litgpt_own_model.txt").read_text()
    qlora = {m[1]: (m[2], m[3] + "%") for m in re.finditer(r"^(\S+/qlora\.yaml)\s+[\d.]+ GB\s+([\d.]+) GB\s+"
                                                           r"([+-][\d.]+)%", stored, re.M)}
    assert qlora == PP._LITGPT_QLORA_TRACED and len(qlora) == 3
    for name, _, _, why in PP.NOT_EXPRESSIBLE:
        cfg = name.split(": ", 1)[1].split(", ")[0]
        if cfg in qlora:
            assert f"{qlora[cfg][0]} GB, {qlora[cfg][1]}" in why


def test_the_summary_counts_the_litgpt_rows_own_model(capsys):
    assert PP.main("litgpt config_hub") == 0
    out = capsys.readouterr().out
    errs = sorted(float(t[1][:-1]) for t in _stored_litgpt_trace().values())
    assert (f"  the {len(LITGPT_OFF)} litgpt rows among them miss by their model: litgpt's own GPT and LoRA, traced by "
            f"tools/trace_litgpt.py (results/cpu/litgpt_own_model.txt), is within {errs[0]:+.1f}% to {errs[-1]:+.1f}% "
            f"of all 6 litgpt figures") in out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(2, 9), st.sampled_from([torch.bfloat16, torch.float16]),
       st.integers(0, 2**31 - 1))
def test_litgpt_loss_and_fabric_outputs(b, chunks, vocab, dtype, seed):
    # Fabric's cast: a new list of float32 tensors, the values kept, integer tensors left; litgpt's chunked loss:
    # the mean cross-entropy over the targets that are not -100 (the chunk list and the one tensor alike)
    g = torch.Generator().manual_seed(seed)
    t = 3 * chunks
    logits = torch.randn(b, t, vocab, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (b, t), generator=g)
    targets[torch.rand(b, t, generator=g) < 0.3] = -100
    out = [logits[:, i:i + 3] for i in range(0, t, 3)]
    cast = PP.fabric_outputs(out)
    assert cast is not out and all(c.dtype == torch.float32 for c in cast) and out[0].dtype == dtype
    assert torch.equal(torch.cat(cast, 1), logits.float())
    assert PP.fabric_outputs(targets) is targets
    pair = PP.fabric_outputs((logits, targets))  # a tuple stays a tuple, as Fabric's apply_to_collection keeps it
    assert type(pair) is tuple and pair[0].dtype == torch.float32 and pair[1] is targets
    want = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1), ignore_index=-100,
                           reduction="sum") / max(1, int((targets != -100).sum()))
    assert torch.allclose(PP.litgpt_loss(cast, targets), want, atol=1e-5)
    assert torch.allclose(PP.litgpt_loss(logits.float(), targets), want, atol=1e-5)


def _trace_litgpt_tool():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools/trace_litgpt.py"
    spec = importlib.util.spec_from_file_location("trace_litgpt", path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules["trace_litgpt"] = tool
    spec.loader.exec_module(tool)
    return tool


def test_trace_litgpt_names_bad_input(tmp_path):
    tool = _trace_litgpt_tool()
    with pytest.raises(SystemExit, match=r"--src .* is not a litgpt source tree \(missing .*litgpt/model\.py"):
        tool.load_litgpt(tmp_path)
    with pytest.raises(SystemExit, match=r"--rows 'gemma-2b/lora.yaml,nope.yaml' is invalid \(unknown nope.yaml\); "
                                         r"allowed: gemma-2b/lora.yaml, tiny-llama/lora.yaml"):
        tool.main(["--src", str(tmp_path), "--rows", "gemma-2b/lora.yaml,nope.yaml"])
    # the stored rows are the tool's rows: the same configs, figures and settings as validate's
    figs = {f.name.split(": ", 1)[1].split(", ")[0]: f for f in PP.FIGURES if f.name.startswith("litgpt config_hub")}
    assert [r[0] for r in tool.ROWS] == list(PP._LITGPT_OWN_TRACED) == list(figs)
    for cfg, _, gb, batch, accum, lora in tool.ROWS:
        f = figs[cfg]
        assert f.measured_bytes == round(gb * 1e9) and f.settings["batch_size"] == batch
        assert f.settings.get("grad_accum", 1) == accum
        assert (lora is None) == (f.kind == "full")
        if lora:
            assert (f.settings["lora_r"], f.settings["lora_alpha"], f.settings["lora_dropout"]) == \
                (lora["r"], lora["alpha"], lora["dropout"])


def test_litgpts_own_model_traced_equals_the_stored_trace():
    """Needs a litgpt source tree at commit bc3c337f in MEMLAB_LITGPT_SRC (tools/trace_litgpt.py's docstring): the
    TinyLlama LoRA row traced as the tool does equals the stored figure, and is within 3% of the published one."""
    import os
    from pathlib import Path

    src = os.environ.get("MEMLAB_LITGPT_SRC")
    if not src:
        pytest.skip("MEMLAB_LITGPT_SRC is not set (a litgpt checkout at bc3c337f; see tools/trace_litgpt.py)")
    tool = _trace_litgpt_tool()
    lora_mod = tool.load_litgpt(Path(src))
    cfg, name, gb, batch, accum, lora = tool.ROWS[1]
    est = tool.estimate_row(lora_mod, name, batch, accum, lora, fabric=True)
    assert f"{est.allocated_bytes / 1e9:.2f}" == _stored_litgpt_trace()[cfg][0]
    assert abs(est.allocated_bytes / (gb * 1e9) - 1) <= 0.03


def test_fms_fsdp_rows_trace_fsdp1_as_the_source_ran():
    """fms-acceleration's 2-GPU rows ran accelerate's FSDP1 (FULL_SHARD): traced with fsdp_version=1; FSDP2 (the
    estimator's default) lands within the target too, the peak (the optimizer step over each rank's shard) being
    the same bytes but for FSDP1's flat-parameter bookkeeping."""
    figs = [f for f in PP.FIGURES if f.name.startswith("fms-acceleration: FSDP over 2 GPUs")]
    assert len(figs) == 2
    for f in figs:
        assert f.settings["fsdp_version"] == 1 and f.settings["world_size"] == 2 and f.settings["zero_stage"] == 3
        v1, v2 = PP._estimate(f), PP._estimate(f, fsdp_version=2)
        for est in (v1, v2):
            assert abs(est.allocated_bytes / f.measured_bytes - 1) <= 0.03 and est.peak_phase == "optimizer"
        assert abs(v1.allocated_bytes - v2.allocated_bytes) < 1 * 2**20


def test_the_torchtune_rows_quote_the_stored_trace_of_torchtunes_own_model():
    """The torchtune rows' texts quote tools/trace_torchtune.py's estimates of torchtune's own Llama (torchtune is
    no dependency: the stored output is the record); each quoted figure and error is the stored row's, never typed
    apart from it. Where torchtune is installed, tests/ch01 re-traces the plain row (below)."""
    import re
    from pathlib import Path

    stored = (Path(__file__).resolve().parents[2] / "results/cpu/torchtune_own_model.txt").read_text()
    traced = {m[1].strip(): (m[2], m[3]) for m in re.finditer(r"^(\+ [^\n]+?)\s+[\d.]+ GiB\s+([\d.]+) GiB\s+([+-][\d.]+)%",
                                                             stored, re.M)}
    assert len(traced) == 4 and stored.startswith("torchtune 0.4.0")
    for f in (f for f in PP.FIGURES if f.name.startswith("torchtune optimization flags")):
        technique = f.name.split(": ", 1)[1].split(", Llama")[0]
        gib, err = traced[technique]
        text = f.off + f.differs
        assert f"{gib} GiB, {err}%" in text, (technique, gib, err)


def test_torchtunes_own_llama_traced_meets_the_packed_row():
    """Needs torchtune 0.4.0 (tools/trace_torchtune.py's docstring): its own Llama, traced as the tool does, is
    within 3% of the plain (packed, eager) row's figure, and equals the stored trace."""
    pytest.importorskip("torchtune", reason="torchtune is not installed (see tools/trace_torchtune.py)")
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools/trace_torchtune.py"
    spec = importlib.util.spec_from_file_location("trace_torchtune", path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules["trace_torchtune"] = tool
    spec.loader.exec_module(tool)
    if not tool._torchtune().startswith("0.4.0"):
        pytest.skip("torchtune other than 0.4.0 installed: its model differs from the run's")
    name, gib, kw = tool.ROWS[0]
    assert name == "+ Packed Dataset"
    allocated = tool.estimate_row(**kw).allocated_bytes
    assert abs(allocated / (gib * GiB) - 1) <= 0.03
    assert f"{allocated / GiB:.2f} GiB" in (path.parents[1] / "results/cpu/torchtune_own_model.txt").read_text()
