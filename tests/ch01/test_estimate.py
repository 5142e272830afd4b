"""memlab.estimate: fake-tensor estimates equal real tracked peaks; formulas; the CLI."""
from __future__ import annotations


import pytest
import torch

from memlab import estimate as E
from memlab.cli import estimate as estimate_cli
from memlab.estimate import (
    MemoryEstimate,
    accelerate_estimate,
    deepspeed_zero_estimate,
    estimate_training_memory,
    measure_training_memory,
)
from memlab.models import (
    PRESETS,
    TinyGPT,
    TinyGPTConfig,
    UnknownPresetError,
    preset_parameter_count,
    tiny_llama,
    tiny_llama_config,
)


def small_gpt():
    return TinyGPT(TinyGPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=64))


def small_llama():
    return tiny_llama(hidden_size=64, intermediate_size=160, num_hidden_layers=2)


MODELS = {"tinygpt": small_gpt, "tiny_llama": small_llama}


# ---------------------------------------------------------------- estimate == measured


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_equals_real_cpu_peak(name, dtype, checkpointing):
    kw = dict(batch_size=2, seq_len=32, dtype=dtype, optimizer="adamw", checkpointing=checkpointing, device="cpu")
    est = estimate_training_memory(MODELS[name], **kw)
    real = measure_training_memory(MODELS[name], **kw)
    assert est.fake and not real.fake
    assert est.peak_bytes == real.peak_bytes, (est.peak_bytes, real.peak_bytes)
    assert est.breakdown == real.breakdown
    assert est.breakdown_end == real.breakdown_end
    assert set(est.breakdown) == set(E.CATEGORIES)
    assert sum(est.breakdown.values()) == est.peak_bytes


@pytest.mark.parametrize(
    "dtype,optimizer,impl",
    [("bf16-pure", "adamw", "auto"), ("fp16", "sgd", "auto"), ("fp32", "adamw8bit", "auto"),
     ("bf16", "adamw", "foreach"), ("fp32", "adamw", "fused")],
)
def test_estimate_equals_real_other_recipes(dtype, optimizer, impl):
    kw = dict(batch_size=2, seq_len=32, dtype=dtype, optimizer=optimizer, optimizer_impl=impl, device="cpu")
    est = estimate_training_memory(small_gpt, **kw)
    real = measure_training_memory(small_gpt, **kw)
    assert est.peak_bytes == real.peak_bytes
    assert est.breakdown == real.breakdown


def test_checkpointing_lowers_activation_peak():
    from memlab.testing import assert_peak

    kw = dict(batch_size=4, seq_len=64, dtype="fp32", optimizer="sgd", device="cpu")
    plain = estimate_training_memory(small_gpt, **kw)
    # below the plain step's peak (a failure names the phase, module and op at the checkpointed peak)
    ck = assert_peak(small_gpt, checkpointing=True, at_most=plain.peak_bytes - 1, **kw)
    assert ck.max_activation_bytes < plain.max_activation_bytes


def test_model_states_fp32_adamw_are_16_bytes_per_param():
    """End of a steady step, fp32 AdamW (for-loop): 4 (weights) + 4 (grads) + 8 (moments) bytes
    per parameter, plus one fp32 `step` scalar per parameter tensor."""
    est = estimate_training_memory(small_llama, batch_size=1, seq_len=16, dtype="fp32", device="cpu")
    model = small_llama()
    P = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert est.n_params == P
    assert est.breakdown_end["parameters"] == 4 * P + buffers
    assert est.breakdown_end["gradients"] == 4 * P
    assert est.breakdown_end["optimizer"] == 8 * P + 4 * n_tensors


def test_bf16_amp_keeps_fp32_states_and_pure_halves_them():
    kw = dict(batch_size=1, seq_len=16, device="cpu")
    from memlab.testing import assert_peak

    amp = estimate_training_memory(small_gpt, dtype="bf16", **kw)
    pure = assert_peak(small_gpt, dtype="bf16-pure", at_most=amp.peak_bytes - 1, **kw)  # below mixed precision's
    assert amp.breakdown_end["gradients"] == 2 * pure.breakdown_end["gradients"]


def test_adamw8bit_state_matches_bitsandbytes_layout():
    est = estimate_training_memory(small_llama, batch_size=1, seq_len=16, dtype="fp32", optimizer="adamw8bit", device="cpu")
    model = small_llama()
    layout = E.optim.bnb_state_bytes(model)
    # + the two shared 256-entry fp32 quantization maps that bitsandbytes keeps in the state
    assert est.breakdown_end["optimizer"] == layout + 2 * 256 * 4
    full = estimate_training_memory(small_llama, batch_size=1, seq_len=16, dtype="fp32", optimizer="adamw", device="cpu")
    assert est.breakdown_end["optimizer"] < full.breakdown_end["optimizer"] / 2


def test_preset_and_config_inputs():
    est = estimate_training_memory("llama-2-7b", batch_size=1, seq_len=64, config_overrides={"num_hidden_layers": 1})
    assert est.n_params == preset_parameter_count("llama-2-7b", num_hidden_layers=1)
    assert est.peak_bytes > 16 * est.n_params  # AdamW mixed precision: 16 bytes/param + more
    cfg = tiny_llama_config(num_hidden_layers=1)
    est2 = estimate_training_memory(cfg, batch_size=1, seq_len=16, device="cpu")
    assert est2.n_params == sum(p.numel() for p in tiny_llama(num_hidden_layers=1).parameters())


def test_config_json_path(tmp_path):
    path = tmp_path / "config.json"
    tiny_llama_config(num_hidden_layers=1).to_json_file(str(path))
    a = estimate_training_memory(str(path), batch_size=1, seq_len=16, device="cpu")
    b = estimate_training_memory(tiny_llama_config(num_hidden_layers=1), batch_size=1, seq_len=16, device="cpu")
    assert a.peak_bytes == b.peak_bytes


def test_bad_arguments():
    with pytest.raises(UnknownPresetError, match="llama-2-7b"):
        estimate_training_memory("llama-9", batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="dtype='fp8'.*allowed"):
        estimate_training_memory(small_gpt, batch_size=1, seq_len=8, dtype="fp8")
    with pytest.raises(ValueError, match="optimizer='lion'.*allowed"):
        estimate_training_memory(small_gpt, batch_size=1, seq_len=8, optimizer="lion")
    with pytest.raises(ValueError, match="batch_size=0"):
        estimate_training_memory(small_gpt, batch_size=0, seq_len=8)
    with pytest.raises(TypeError, match="pass a function"):
        estimate_training_memory(small_gpt(), batch_size=1, seq_len=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batch'"):
        estimate_training_memory(small_gpt, batch=1, seq_len=8)
    with pytest.raises(TypeError, match="missing batch_size"):
        estimate_training_memory(small_gpt, seq_len=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'world_size'"):
        measure_training_memory(small_gpt, batch_size=1, seq_len=8, world_size=2)


def test_a_step_spec_and_keywords_are_one_call():
    """The StepSpec form is the real one; the keywords build the same StepSpec (make_step), or change a given one."""
    spec = E.StepSpec(batch_size=2, seq_len=16, dtype="bf16", device="cpu")
    assert spec == E.make_step(batch_size=2, seq_len=16, dtype="bf16-mixed", device="cpu") and spec.dtype == "bf16-mixed"
    a = estimate_training_memory(small_gpt, spec)
    b = estimate_training_memory(small_gpt, batch_size=2, seq_len=16, dtype="bf16", device="cpu")
    c = estimate_training_memory(small_gpt, E.StepSpec(batch_size=1, seq_len=16, device="cpu"), batch_size=2,
                                 dtype="bf16")
    assert a.peak_bytes == b.peak_bytes == c.peak_bytes and a.dtype == c.dtype == "bf16-mixed"


def test_one_canonicaliser_one_error_everywhere():
    """core.vocab is the one canonicaliser: the estimator, the planner and the rules of thumb map a spelling one
    way and refuse an unknown one with the same message."""
    from memlab.core import vocab
    from memlab.estimate import peers
    from memlab.plan.stack import Stack, canonical_precision

    assert E.StepSpec(1, 8, dtype="BF16").dtype == Stack(precision="BF16").precision == "bf16-mixed"
    assert E.StepSpec(1, 8, optimizer="adam8bit").optimizer == Stack(optimizer="adam8bit").optimizer == "adamw8bit"
    errors = set()
    for bad in (lambda: E.StepSpec(1, 8, dtype="fp8"), lambda: vocab.recipe("fp8", argument="dtype"),
                lambda: canonical_precision("fp8", argument="dtype"), lambda: peers.accelerate_estimate(1, "fp8"),
                lambda: E.training_step(None, None, None, None, dtype="fp8")):
        with pytest.raises(ValueError) as exc:
            bad()
        errors.add(str(exc.value))
    assert len(errors) == 1 and "(aliases: 'bf16'='bf16-mixed'" in errors.pop()
    with pytest.raises(ValueError, match=r"optimizer='lion' is invalid; allowed: 'adamw', 'sgd'"):
        E.StepSpec(1, 8, optimizer="lion")
    with pytest.raises(ValueError, match=r"optimizer='sgd' is invalid; allowed: 'adamw', 'adamw-fused'"):
        Stack(optimizer="sgd")  # the planner's own set, the same aliases and message


def test_fits_and_table():
    est = estimate_training_memory(small_gpt, batch_size=1, seq_len=16, device="cpu")
    assert isinstance(est, MemoryEstimate)
    assert est.fits(est.peak_bytes) and not est.fits(est.peak_bytes - 1)
    assert est.fits("1GB") and not est.fits("1KB")
    assert est.headroom(est.peak_bytes + 10) == 10
    text = est.table()
    for key in E.CATEGORIES:
        assert key in text
    assert f"{est.peak_bytes:,}" in text


# ---------------------------------------------------------------- reference formulas


@pytest.mark.parametrize("dtype,acc", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_accelerate_estimate_matches_accelerate(dtype, acc):
    from accelerate.commands.estimate import estimate_training_usage

    n = 7_000_000_123
    sizes = estimate_training_usage(4 * n, acc)  # accelerate sizes an fp32 model
    assert accelerate_estimate(n, dtype) == max(sizes.values())


def test_deepspeed_zero_formulas():
    P, L = 1_000_000, 50_000
    assert deepspeed_zero_estimate(P, stage=2)["gpu"] == 20 * P  # 4P + 16P/1
    assert deepspeed_zero_estimate(P, stage=2, num_gpus=8)["gpu"] == 4 * P + 2 * P
    assert deepspeed_zero_estimate(P, stage=2, cpu_offload=True)["gpu"] == 2 * P
    assert deepspeed_zero_estimate(P, stage=2, cpu_offload=True)["cpu"] == int(P * 16 * 1.5)
    assert deepspeed_zero_estimate(P, stage=3, largest_layer_params=L)["gpu"] == 4 * L + 18 * P
    assert deepspeed_zero_estimate(P, stage=3, largest_layer_params=L, cpu_offload=True, cpu_offload_params=True)["gpu"] == 4 * L
    with pytest.raises(ValueError, match="stage"):
        deepspeed_zero_estimate(P, stage=1)


# ---------------------------------------------------------------- CLI


def test_cli_fits(capsys, tmp_path):
    path = tmp_path / "config.json"
    tiny_llama_config(num_hidden_layers=1).to_json_file(str(path))
    code = estimate_cli.main([str(path), "--batch-size", "1", "--seq-len", "16", "--gpu", "24GB"])
    out = capsys.readouterr().out
    assert code == 0
    assert "verdict: FITS" in out and "parameters" in out
    assert "22.35 GiB (24GB, decimal units)" in out and "CUDA context" in out


def test_cli_does_not_fit_suggests(capsys):
    # one Llama-2-7B layer (0.46B parameters with its 32k embeddings and head): 7 GiB of fp32 AdamW states
    code = estimate_cli.main(["llama-2-7b", "--set", "num_hidden_layers=1", "--batch-size", "1", "--seq-len", "8",
                   "--dtype", "fp32", "--gpu", "4GiB"])
    out = capsys.readouterr().out
    assert code == 0
    assert "DOES NOT FIT" in out
    assert "peak in" in out and "fwd/bwd peak" in out
    # the foreach AdamW's temporaries hold the peak at this size: the fused one is suggested, traced
    assert "the optimizer step holds the peak" in out and "fused AdamW" in out
    for technique in ("gradient checkpointing", "8-bit AdamW", "CPU-offloaded AdamW", "QLoRA"):
        assert technique in out
    assert "traced" in out and "formula" in out


@pytest.mark.parametrize(
    "argv,needle",
    [(["llama-9"], "allowed: a preset"), (["llama-2-7b", "--gpu", "abc"], "allowed"),
     (["llama-2-7b", "--gpu", "0.4"], "less than 1 GiB"), (["llama-2-7b", "--gpu", "h100-8gb"], "did you mean h100-80gb"),
     (["llama-2-7b", "--set", "num_hiden_layers=2"], "did you mean num_hidden_layers"),
     (["llama-2-7b", "--seq-len", "8192"], "max_position_embeddings=4096"),
     (["gpt2", "--seq-len", "4096", "--allow-longer-seq"], "n_positions=1024"),
     (["llama-2-7b", "--step", "nosuchmodule_xyz:fn"], "cannot import module 'nosuchmodule_xyz'"),
     (["llama-2-7b", "--dtype", "fp8"], "invalid choice"), (["llama-2-7b", "--optimizer", "lion"], "invalid choice"),
     (["llama-2-7b", "--batch-size", "0"], "positive int")],
)
def test_cli_errors(capsys, argv, needle):
    try:
        code = estimate_cli.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err
    if argv == ["llama-9"]:
        assert all(p in err for p in PRESETS)


def test_cli_dispatch():
    from memlab.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["estimate", "--help"])
    assert exc.value.code == 0


# ---------------------------------------------------------------- CUDA


def _cuda_tracked_peak(build, **kw) -> tuple[int, int]:
    """The same step run for real on CUDA: MemoryTracker's peak, and max_memory_allocated minus what
    was allocated before the step and is not the model's (batch, cuBLAS workspaces)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    real = E.measure_training_memory(build, device="cuda", **kw)
    torch.cuda.synchronize()
    return real.peak_bytes, torch.cuda.max_memory_allocated() - before


def cuda_gpt():
    return TinyGPT(TinyGPTConfig(n_layer=6, n_embd=512, n_head=8, block_size=512))


def cuda_llama():
    return tiny_llama(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=512)


@pytest.mark.cuda
@pytest.mark.parametrize("build", [cuda_gpt, cuda_llama], ids=["tinygpt", "tiny_llama"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_cuda_estimate_matches_the_real_step(build, dtype, checkpointing):
    # The fake trace of a CUDA step against the same step run on the GPU and tracked (the tracker is
    # checked against the allocator in test_profiler); the allocator's own peak bounds it from above.
    kw = dict(batch_size=8, seq_len=512, dtype=dtype, checkpointing=checkpointing)
    # without the per-op scratch rule: what a dispatch-level tracker sees, on both sides
    seen = estimate_training_memory(build, device="cuda", kernel_scratch=False, **kw)
    est = estimate_training_memory(build, device="cuda", **kw)
    assert est.traced_on.startswith("cuda")
    tracked, allocated = _cuda_tracked_peak(build, **kw)
    assert abs(seen.peak_bytes - tracked) <= 0.01 * tracked, (seen.peak_bytes, tracked)
    # the stated allocated estimate (tensors, softmax-backward scratch, cuBLAS workspaces) against the
    # allocator's own peak: within 3% (the workspaces exist only if this step created them: then they count)
    assert abs(est.allocated_bytes - allocated) <= 0.03 * allocated + 2 * 32 * 2**20, (est.allocated_bytes, allocated)


# ---------------------------------------------------------------- bench


def test_bench_profiler_runs(capsys):
    from memlab.bench import profiler as bench

    code = bench.main(["--repeat", "1", "--batch-size", "1", "--seq-len", "16", "--skip-estimate"])
    out = capsys.readouterr().out
    assert "memlab MemoryTracker" in out and "torch MemTracker" in out
    # without --strict a missed target is reported, not failed (timings on a shared machine are noisy)
    assert code == 0 and ("TARGET MET" in out or "TARGET MISSED" in out)


# ---------------------------------------------------------------- issue 10: the step people run


def vocab_llama_config(**kw):
    # a real-sized vocabulary next to tiny layers: the logits dominate, as in a real fine-tune
    base = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, vocab_size=4096, max_position_embeddings=64)
    return tiny_llama_config(**{**base, **kw})


def test_config_torch_dtype_is_ignored(tmp_path):
    """A config.json that says bfloat16 still builds fp32 weights for the bf16 AMP recipe."""
    plain, typed = tmp_path / "plain.json", tmp_path / "typed.json"
    tiny_llama_config(num_hidden_layers=1).to_json_file(str(plain))
    import json as _json

    data = _json.loads(plain.read_text())
    data["torch_dtype"] = data["dtype"] = "bfloat16"
    typed.write_text(_json.dumps(data))
    kw = dict(batch_size=1, seq_len=16, device="cpu")
    a = estimate_training_memory(str(plain), dtype="bf16", **kw)
    b = estimate_training_memory(str(typed), dtype="bf16", **kw)
    assert a.peak_bytes == b.peak_bytes and a.breakdown_end == b.breakdown_end
    P = a.n_params
    assert b.breakdown_end["gradients"] == 4 * P  # fp32 gradients: fp32 weights
    pure = estimate_training_memory(str(typed), dtype="bf16-pure", **kw)
    assert pure.breakdown_end["gradients"] == 2 * P


def my_step(model, batch):
    """A user's own step: transformers' loss with label smoothing off, called their way."""
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss * 1.0


@pytest.mark.parametrize("loss,step", [("auto", None), ("memlab", None), ("auto", my_step)], ids=["hf", "memlab", "step"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_each_step_kind_estimate_equals_real(loss, step, dtype):
    kw = dict(batch_size=2, seq_len=32, dtype=dtype, device="cpu", loss=loss, step=step)
    est = estimate_training_memory(vocab_llama_config(), **kw)
    real = measure_training_memory(vocab_llama_config(), **kw)
    assert est.peak_bytes == real.peak_bytes and est.breakdown == real.breakdown
    assert est.phase_peaks == real.phase_peaks and est.peak_phase == real.peak_phase
    assert ("transformers' loss" in est.step) == (loss == "auto" and step is None)


def test_cli_step(tmp_path, monkeypatch, capsys):
    (tmp_path / "mystep_mod.py").write_text(
        "def loss_fn(model, batch):\n    return model(input_ids=batch['input_ids'], labels=batch['labels']).loss\n")
    monkeypatch.chdir(tmp_path)
    code = estimate_cli.main(["llama-2-7b", "--set", "num_hidden_layers=1", "--set", "hidden_size=64", "--set", "intermediate_size=64",
                   "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
                   "--seq-len", "16", "--step", "mystep_mod:loss_fn"])
    out = capsys.readouterr().out
    assert code == 0 and "your step mystep_mod.loss_fn" in out
    code = estimate_cli.main(["llama-2-7b", "--step", "mystep_mod:nope"])
    assert code == 2 and "has no function 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------- issue 9 item 8: input that cannot run


def test_input_validation(tmp_path):
    with pytest.raises(ValueError, match="seq_len=4096 exceeds.*n_positions=1024"):
        estimate_training_memory("gpt2", batch_size=1, seq_len=4096)
    with pytest.raises(ValueError, match="allow_longer_seq"):
        estimate_training_memory("llama-2-7b", batch_size=1, seq_len=8192)
    with pytest.raises(ValueError, match="'num_hiden_layers'.*did you mean num_hidden_layers"):
        estimate_training_memory("llama-2-7b", batch_size=1, seq_len=8, config_overrides={"num_hiden_layers": 1})
    with pytest.raises(ValueError, match="'hiden_size'"):
        estimate_training_memory(tiny_llama_config(), batch_size=1, seq_len=8, config_overrides={"hiden_size": 8})
    bare = tmp_path / "bare.json"
    bare.write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"bare.json.*lacks hidden_size / n_embd / d_model, num_hidden_layers"):
        estimate_training_memory(str(bare), batch_size=1, seq_len=8)
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"broken.json.*not valid JSON.*line 1"):
        estimate_training_memory(str(broken), batch_size=1, seq_len=8)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        estimate_training_memory(str(tmp_path / "missing.json"), batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="attn_implementation='flash' is a CUDA kernel"):
        estimate_training_memory(tiny_llama_config(), batch_size=1, seq_len=8, device="cpu", attn_implementation="flash")
    with pytest.raises(ValueError, match="loss='xent' is invalid"):
        estimate_training_memory(small_gpt, batch_size=1, seq_len=8, loss="xent")
    # the override flag lets a RoPE model go further (a fake trace has no table to overrun)
    est = estimate_training_memory(tiny_llama_config(num_hidden_layers=1, max_position_embeddings=16), batch_size=1,
                                   seq_len=32, allow_longer_seq=True, device="cpu")
    assert est.seq_len == 32


def test_cli_gpu_validated_before_tracing(monkeypatch, capsys):
    def boom(*a, **k):
        raise AssertionError("traced before --gpu was validated")

    monkeypatch.setattr(estimate_cli, "estimate_training_memory", boom)
    with pytest.raises(SystemExit) as exc:
        estimate_cli.main(["llama-2-7b", "--gpu", "0.4"])
    assert exc.value.code == 2 and "less than 1 GiB" in capsys.readouterr().err


def test_cli_bad_config_file_named(tmp_path, capsys):
    bad = tmp_path / "cfg.json"
    bad.write_text("not json")
    assert estimate_cli.main([str(bad)]) == 2
    assert "cfg.json" in capsys.readouterr().err


# ---------------------------------------------------------------- GPUs by name and true size


def test_gpu_presets_and_sizes():
    from memlab.core import gpus

    label, usable = E.resolve_gpu("h100-80gb")
    assert usable == 85_017_493_504 - gpus.CONTEXT_RESERVE_BYTES and "79.18 GiB" in label
    assert E.resolve_gpu("H100")[1] == usable
    assert gpus.GPUS["rtx4090"].total_bytes == 24564 * 2**20
    label, usable = E.resolve_gpu("24GB")
    assert usable == 24 * 10**9 - gpus.CONTEXT_RESERVE_BYTES and "22.35 GiB" in label and "decimal" in label
    assert E.resolve_gpu("24GiB")[1] == 24 * 2**30 - gpus.CONTEXT_RESERVE_BYTES
    for bad in ("0.4", "h100-8gb", "", "512MiB"):
        with pytest.raises(ValueError, match="allowed"):
            E.resolve_gpu(bad)


def test_cuda_target_extras_and_fits():
    est = estimate_training_memory(small_gpt, batch_size=1, seq_len=16, device="cuda", optimizer_impl="for-loop")
    assert est.allocated_bytes == est.peak_bytes + 64 * 2**20
    # reserved: the traced allocations replayed through the caching allocator's model (tests/ch01/test_caching_allocator.py)
    assert est.reserved_bytes == est.reserved_replay_bytes and est.reserved_bytes % (2 * 2**20) == 0
    assert est.allocated_bytes <= est.reserved_bytes < est.allocated_bytes * 1.14
    assert est.fits("h100-80gb") and est.fits("1GiB")  # 1 GiB - the context reserve: a tiny model still fits
    assert est.headroom("1GiB") == 2**30 - 718_077_952 - est.reserved_bytes
    text = est.table()
    assert "cuBLAS workspaces" in text and "reserved" in text and "phase peaks" in text


# ---------------------------------------------------------------- attention kernels


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_each_cpu_kernel_estimate_equals_real(attn, dtype):
    kw = dict(batch_size=2, seq_len=32, dtype=dtype, device="cpu", attn_implementation=attn)
    est = estimate_training_memory(vocab_llama_config(), **kw)
    real = measure_training_memory(vocab_llama_config(), **kw)
    assert est.peak_bytes == real.peak_bytes and est.breakdown == real.breakdown
    assert est.attention.startswith(attn)


def padded_step(model, batch):
    """A right-padded batch (the last token of every sample but the first is padding), as a collator pads."""
    x = batch["input_ids"]
    keep = torch.ones_like(x)
    keep[1:, -1] = 0
    return model(input_ids=x, attention_mask=keep, labels=x).loss


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("step", [None, padded_step], ids=["unpadded", "padded"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_sdpa_mask_path_estimate_equals_real(kv_heads, step, checkpointing):
    """Where attention sets the peak (small vocabulary, 128 tokens), the fake trace takes the mask path a real
    step takes: no mask and SDPA's own GQA for an unpadded batch (transformers cannot read fake position ids
    and would build a full mask and repeat K/V: 5.7% over before the trace told it the batch is unpacked),
    the padding mask and repeated K/V for a padded one."""
    cfg = vocab_llama_config(num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=64,
                             max_position_embeddings=128)
    kw = dict(batch_size=2, seq_len=128, dtype="bf16", device="cpu", attn_implementation="sdpa",
              checkpointing=checkpointing, step=step)
    est = estimate_training_memory(cfg, **kw)
    real = measure_training_memory(cfg, **kw)
    assert est.peak_bytes == real.peak_bytes and est.breakdown == real.breakdown
    assert est.phase_peaks == real.phase_peaks
    assert ("padding mask" in est.attention) == (step is not None) == ("padding mask" in real.attention)
    assert ("batch traced as unpacked" in " ".join(est.notes)) == (step is None)
    if step is None and not checkpointing:
        padded = estimate_training_memory(cfg, **{**kw, "step": padded_step})
        assert padded.peak_bytes > est.peak_bytes  # the mask (and repeated K/V under GQA) are kept


def test_cuda_target_attention_is_modelled():
    kw = dict(batch_size=2, seq_len=64, device="cuda", optimizer_impl="for-loop", extrapolate=False)
    gqa = vocab_llama_config(num_attention_heads=4, num_key_value_heads=2)
    flash = estimate_training_memory(gqa, dtype="bf16", attn_implementation="sdpa", **kw)
    assert "CUDA flash kernel" in flash.attention
    math_ = estimate_training_memory(gqa, dtype="fp32", attn_implementation="sdpa", **kw)
    eff = estimate_training_memory(gqa, dtype="fp32", attn_implementation="sdpa", config_overrides={"num_key_value_heads": 4}, **kw)
    assert "math kernel" in math_.attention and "memory-efficient" in eff.attention
    # fp32 GQA on CUDA keeps the b x h x s x s probabilities: more activations than the fused kernel
    assert math_.max_activation_bytes > eff.max_activation_bytes
    eager_cuda = estimate_training_memory(gqa, dtype="fp32", attn_implementation="eager", **kw)
    eager_cpu = estimate_training_memory(gqa, dtype="fp32", attn_implementation="eager", **{**kw, "device": "cpu"})
    assert any("softmax backward" in n for n in eager_cuda.notes)
    # the rule adds one fp32 b x h x s x s matrix while softmax backward runs
    assert eager_cuda.tracker.scratch_bytes == 2 * 4 * 64 * 64 * 4
    assert eager_cuda.phase_peaks["backward"] >= eager_cpu.phase_peaks["backward"]
    assert eager_cuda.allocated_bytes == eager_cuda.peak_bytes + 64 * 2**20


# ---------------------------------------------------------------- extrapolation by layer count


@pytest.mark.parametrize("kw", [
    dict(dtype="fp32"), dict(dtype="bf16"), dict(dtype="bf16", checkpointing=True),
    dict(dtype="fp32", batch_size=1, seq_len=4), dict(dtype="bf16", device="cpu", optimizer_impl="foreach"),
    dict(dtype="bf16-pure", optimizer="adamw8bit"), dict(dtype="fp32", attn_implementation="sdpa"),
    dict(dtype="bf16", attn_implementation="sdpa", loss="memlab"),
], ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_extrapolation_equals_full_trace(kw):
    cfg = tiny_llama_config(num_hidden_layers=6, hidden_size=64, intermediate_size=160, vocab_size=512)
    k = {**dict(batch_size=2, seq_len=32), **kw}
    a = estimate_training_memory(cfg, extrapolate=True, **k)
    b = estimate_training_memory(cfg, extrapolate=False, **k)
    assert a.extrapolated_from and not b.extrapolated_from
    assert a.peak_bytes == b.peak_bytes
    assert a.breakdown == b.breakdown and a.breakdown_end == b.breakdown_end
    assert a.phase_peaks == b.phase_peaks and a.peak_phase == b.peak_phase
    assert a.n_params == b.n_params and a.max_activation_bytes == b.max_activation_bytes
    assert a.tracker.peak_phase == b.tracker.peak_phase and a.tracker.phase_peaks() == b.tracker.phase_peaks()


def test_extrapolation_is_fast_for_big_presets():
    import time

    t0 = time.perf_counter()
    est = estimate_training_memory("llama-2-70b", batch_size=1, seq_len=4096)
    assert est.extrapolated_from and est.n_params == preset_parameter_count("llama-2-70b")
    assert time.perf_counter() - t0 < 20  # 1 s on 2 idle cores; generous for a loaded CI box


@pytest.mark.parametrize("kw", [dict(dtype="bf16"), dict(dtype="fp32", optimizer="adamw8bit"), dict(dtype="bf16-pure", optimizer_impl="fused"),
                                dict(dtype="bf16", optimizer_in_backward=True),
                                dict(dtype="bf16-pure", optimizer="adamw8bit", optimizer_in_backward=True, checkpointing=True),
                                dict(dtype="bf16", adapter="lora", optimizer_in_backward=True)],
                         ids=["bf16", "adamw8bit", "fused", "in-backward", "in-backward-8bit-ckpt", "in-backward-lora"])
def test_fast_warmup_leaves_the_same_state(monkeypatch, kw):
    """The fake trace warms up with an optimizer step on zero gradients (with the optimizer in backward: each
    parameter's own step, as its gradient arrives): the same steady state as a full step, and the same
    caching-allocator replay."""
    k = {**dict(batch_size=2, seq_len=32, extrapolate=False), **kw}

    def seen(est):
        return (est.peak_bytes, est.breakdown, est.breakdown_end, est.phase_peaks, est.reserved_replay_bytes,
                [(ev.phase, ev.bytes) for ev in est.tracker.timeline])

    a = estimate_training_memory(small_llama, **k)
    monkeypatch.setattr(E.trace, "_FAST_WARMUP", False)
    b = estimate_training_memory(small_llama, **k)
    assert a.reserved_replay_bytes > 0  # a CUDA target (the default): the caching allocator replayed
    if k.get("optimizer_in_backward"):  # the gradients freed in backward either way: the same moments
        assert seen(a) == seen(b)
    else:  # a full warm-up's gradients are still alive when tracking starts (the step's zero_grad frees them before
        # its forward): the first moments differ, every figure (the replay's reserved bytes too) is the same
        assert seen(a)[:5] == seen(b)[:5]


# ---------------------------------------------------------------- offload-adamw (chapter 04)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16-pure", "bf16"])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_offload_estimate_device_bytes_equal_real_cpu_run(name, dtype, offload_gradients):
    """The fake trace of optimizer="offload-adamw" against a real CPU step of memlab.offload.OffloadedAdamW
    (fast C++ kernel) tracked by MemoryTracker (measure_training_memory runs it).

    On a CPU host == device, so the real tracker also sees OffloadedAdamW's host buffers: master weights,
    moments and step counters (in optimizer.state) and the fp32 grad slots (kept outside optimizer.state,
    reported by OffloadedAdamW.extra_state_tensors()), all counted from the tracker's start. What is
    compared: parameters and gradients at the end of the step byte for byte; the forward and backward
    peaks equal to the estimate's device peak of that phase + the host state (16 bytes/param + step
    counters); the optimizer-phase peak equal to the estimate's + host_bytes; and the real end-of-step
    bytes beyond parameters and gradients equal to host_bytes.
    """
    kw = dict(batch_size=2, seq_len=32, dtype=dtype, optimizer="offload-adamw", device="cpu",
              optimizer_kwargs={"offload_gradients": offload_gradients})
    est = estimate_training_memory(MODELS[name], **kw)
    real = measure_training_memory(MODELS[name], **kw)
    assert est.fake and not real.fake
    for key in ("parameters", "gradients"):
        assert est.breakdown_end[key] == real.breakdown_end[key]
    if offload_gradients:
        assert est.breakdown_end["gradients"] == 0
    assert est.breakdown["optimizer"] == est.breakdown_end["optimizer"] == 0  # nothing on the device
    assert real.host_bytes == est.host_bytes
    assert est.host_breakdown["fp32 grad slots"] == 4 * est.n_params
    state = 16 * est.n_params + est.host_breakdown["step counters"]
    assert state == est.host_bytes
    assert real.phase_peaks["forward"] == est.phase_peaks["forward"] + state
    assert real.phase_peaks["backward"] == est.phase_peaks["backward"] + state
    assert real.phase_peaks["optimizer"] == est.phase_peaks["optimizer"] + est.host_bytes
    # end of step: beyond params and grads the real run holds the host buffers it was charged for
    dev_end = est.breakdown_end["parameters"] + est.breakdown_end["gradients"]
    assert sum(est.breakdown_end.values()) == dev_end
    assert sum(real.breakdown_end.values()) - dev_end == est.host_bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16-pure"])
def test_offload_host_bytes_are_the_optimizers_buffers(dtype):
    """Host bytes: 16 per trained parameter (fp32 master 4 + fp32 grad slot 4 + two fp32 moments 8; the
    slot is in OffloadedAdamW too, so not the 12 of master + moments alone) + 4 per step counter, equal to
    the buffers a real OffloadedAdamW allocates; a CUDA target adds the pinned staging copy in the
    params' dtype (2 bytes/param for bf16). The device keeps what memlab.offload.predict_device_bytes says."""
    from memlab.offload import OffloadedAdamW, device_host_bytes, predict_device_bytes

    model = E.ModelSpec("small_llama", fn=small_llama).build(dtype, None)  # as the estimator builds it (buffers keep their own dtype)
    P, n = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    kw = dict(batch_size=1, seq_len=16, dtype=dtype, optimizer="offload-adamw")
    cpu = estimate_training_memory(small_llama, device="cpu", **kw)
    assert cpu.n_params == P
    assert cpu.host_bytes == 16 * P + 4 * n == device_host_bytes(P, "offload-adamw")["host"] + 4 * n
    assert cpu.host_breakdown["fp32 master weights"] + cpu.host_breakdown["fp32 moments"] == 12 * P
    opt = OffloadedAdamW(model.parameters())
    real = sum(b.flat.numel() * b.flat.element_size() for bufs in opt._flats for b in bufs.values())
    real += sum(st["step"].numel() * st["step"].element_size() for st in opt.state.values())
    assert cpu.host_bytes == real
    cuda = estimate_training_memory(small_llama, device="cuda", **kw)
    staging = P * (2 if dtype == "bf16-pure" else 4)
    assert cuda.host_breakdown["pinned staging (param dtype)"] == staging
    assert cuda.host_bytes == cpu.host_bytes + staging
    end = cpu.breakdown_end
    assert end["parameters"] + end["gradients"] == predict_device_bytes(model, "offload")
    grads = estimate_training_memory(small_llama, device="cpu", optimizer_kwargs={"offload_gradients": True}, **kw)
    assert grads.breakdown_end["parameters"] + grads.breakdown_end["gradients"] == predict_device_bytes(model, "offload grads")
    assert grads.host_bytes == cpu.host_bytes


def test_offload_table_extrapolation_cli_and_errors(capsys):
    kw = dict(batch_size=1, seq_len=64, dtype="bf16-pure", device="cuda")
    plain = estimate_training_memory("llama-2-7b", optimizer="adamw", **kw)
    off = estimate_training_memory("llama-2-7b", optimizer="offload-adamw", **kw)
    assert off.extrapolated_from and off.host_bytes == 16 * off.n_params + off.host_breakdown["step counters"] + 2 * off.n_params
    assert off.peak_bytes < plain.peak_bytes and off.breakdown_end["optimizer"] == 0
    four = dict(kw, optimizer="offload-adamw", config_overrides={"num_hidden_layers": 6})
    ex, full = (estimate_training_memory("llama-2-7b", extrapolate=x, **four) for x in ("auto", False))
    assert ex.extrapolated_from and not full.extrapolated_from
    assert (ex.host_bytes, ex.host_breakdown, ex.peak_bytes) == (full.host_bytes, full.host_breakdown, full.peak_bytes)
    text = off.table()
    assert "host:" in text and "counted, not traced" in text and "device: traced" in text
    with pytest.raises(ValueError, match="optimizer_kwargs"):
        estimate_training_memory(small_gpt, batch_size=1, seq_len=8, device="cpu", optimizer="offload-adamw",
                                 optimizer_kwargs={"offload_gradient": True})
    with pytest.raises(ValueError, match="offload_gradients"):
        estimate_training_memory(small_gpt, batch_size=1, seq_len=8, device="cpu", optimizer="offload-adamw",
                                 optimizer_kwargs={"offload_gradients": "yes"})
    assert estimate_cli.main(["gpt2", "--seq-len", "64", "--optimizer", "offload-adamw", "--offload-gradients",
                   "--no-suggest"]) == 0
    assert "host:" in capsys.readouterr().out
    assert estimate_cli.main(["gpt2", "--seq-len", "64", "--offload-gradients"]) == 2
    assert "--offload-gradients needs --optimizer offload-adamw" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grad_accum_estimate_equals_real(dtype):
    """Accumulation: the fake trace equals the real step to the byte; the first micro-batch's gradients stay
    through the second (above one micro-batch's peak); a third micro-batch repeats the second."""
    cfg = vocab_llama_config(num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    kw = dict(batch_size=2, seq_len=64, dtype=dtype, device="cpu", attn_implementation="sdpa")
    est = estimate_training_memory(cfg, grad_accum=2, **kw)
    real = measure_training_memory(cfg, grad_accum=2, **kw)
    assert est.peak_bytes == real.peak_bytes and est.breakdown == real.breakdown
    assert est.peak_bytes > estimate_training_memory(cfg, **kw).peak_bytes
    assert estimate_training_memory(cfg, grad_accum=3, **kw).peak_bytes == est.peak_bytes
    assert any("gradient accumulation over 2 micro-batches" in n for n in est.notes)
    with pytest.raises(ValueError, match="grad_accum=0 is invalid"):
        estimate_training_memory(cfg, grad_accum=0, **kw)
