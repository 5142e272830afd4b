"""memlab estimate --zero-stage 3 --fsdp-version 1 against FSDP1 ranks measured by the CPU allocator.

Measured: two gloo processes on this CPU, each wrapping the tiny Llama in PyTorch's
``FullyShardedDataParallel`` as a user does (a unit per decoder layer by ``ModuleWrapPolicy``, every other
argument PyTorch's default: FULL_SHARD), fp32 AdamW, a batch of 2 x 32 per rank; with gradient accumulation
every micro-batch but the last under ``model.no_sync()``. A rank's peak is what it holds when the step starts
(the flat parameters' shards, the optimizer state, the buffers: each storage once) plus the CPU allocator's
rise over the step, replayed from torch.profiler's memory events (memlab.profiler.allocator_peak), a step
repeated until its allocator comes back to where it started (gloo's threads can free a collective's buffer
without an event: such a step's replay is only an upper bound; memlab.distributed.rank_peaks does the same).

Estimated: the same step traced with FSDP1 on fake tensors under a fake process group (fsdp_version=1).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from memlab import distributed as D
from memlab.estimate import estimate_training_memory, make_step
from memlab.estimate.step import StepSpec
from memlab.models import tiny_llama, tiny_llama_config

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

BATCH, SEQ, LAYERS = 2, 32, 4  # per rank; the default tiny Llama
KW = dict(batch_size=BATCH, seq_len=SEQ, dtype="fp32", optimizer="adamw", device="cpu", loss="memlab",
          extrapolate=False)
ACCUM = (1, 2, 3)


def _handles(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m._handle for m in FSDP.fsdp_modules(model) if m._handle is not None]


def _held(model, opt, batch) -> int:
    # bytes alive at the start of a step: parameters (FSDP1's flat shards), buffers, gradients, optimizer state and
    # the batch (the estimate's step makes its batch inside)
    seen, total = set(), 0
    flat = [h.flat_param for h in _handles(model)]  # use_orig_params: the flat parameters hold the bytes
    tensors = (list(model.parameters()) + flat + list(model.buffers()) + [p.grad for p in model.parameters()]
               + list(batch))
    tensors += [v for st in opt.state.values() for v in st.values()]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _fsdp1_rank(rank: int, world_size: int, adapter: str | None = None, checkpointing: bool = False,
                tries: int = 12) -> dict:
    """Each accumulation of ACCUM on this rank: {grad_accum: (held, allocator rise, closed)}. With ``adapter``
    ("lora"), memlab's LoRA layers on the frozen tiny Llama (the estimator's model), wrapped with
    use_orig_params=True as FSDP1 requires for frozen and trained weights in one unit. ``checkpointing``:
    transformers' own (``gradient_checkpointing_enable()``), turned on before the wrap, as the estimator does."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from memlab.models import lm_loss
    from memlab.profiler import allocator_peak

    torch.manual_seed(0)
    if adapter is None:
        base = tiny_llama()
    else:
        from memlab.estimate.adapters import adapter_spec
        from memlab.estimate.model import resolve_model

        base = resolve_model(tiny_llama_config(), None).with_adapter(adapter_spec(adapter, recipe="fp32")).build(
            "fp32", None).train()
    if checkpointing:
        base.gradient_checkpointing_enable()
    layer_type = type(base.model.layers[0])
    model = FSDP(base, auto_wrap_policy=ModuleWrapPolicy({layer_type}), device_id=torch.device("cpu"),
                 use_orig_params=adapter is not None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, base.config.vocab_size, (BATCH, SEQ), generator=g)
    y = torch.randint(0, base.config.vocab_size, (BATCH, SEQ), generator=g)

    def step(accum: int) -> None:  # as memlab.estimate.training_step runs it, accumulation under no_sync
        opt.zero_grad(set_to_none=True)
        for i in range(accum):
            out = lm_loss(model, x, y)
            if i < accum - 1:
                with model.no_sync():
                    (out / accum).backward()
            else:
                (out / accum if accum > 1 else out).backward()
        opt.step()

    step(1)  # the optimizer state exists from here on
    result = {}
    for accum in ACCUM:
        best, closed = None, False
        for _ in range(tries):
            held = _held(model, opt, (x, y))
            rise, end = allocator_peak(lambda: step(accum))
            if not closed and (best is None or end == 0 or held + rise < sum(best)):
                best, closed = (held, rise), end == 0
            still_open = torch.tensor([0 if closed else 1])
            dist.all_reduce(still_open)
            if still_open.item() == 0:
                break
        result[accum] = (best[0], best[1], closed)
    return result


@pytest.fixture(scope="module")
def measured():
    return D.launch(_fsdp1_rank, 2, timeout=600)


@pytest.fixture(scope="module")
def estimates():
    cfg = tiny_llama_config()
    return {(v, a): estimate_training_memory(cfg, world_size=2, zero_stage=3, fsdp_version=v, grad_accum=a, **KW)
            for v in (1, 2) for a in ACCUM}


@pytest.mark.parametrize("accum", ACCUM)
def test_fsdp1_estimate_matches_the_allocator_of_both_ranks(measured, estimates, accum):
    """Measured on this 2-core CPU (torch 2.13, both ranks' replays closed): 10,230,196 B with no accumulation,
    13,396,920 B with 2 and with 3 micro-batches; the estimate 10,230,172 and 13,396,896 B (24 B under: the
    optimizer's step counters). It is traced with FSDP1 itself; gloo holding a buffer for a moment can only raise
    one rank, hence the lower of the two and a 0.5% tolerance."""
    e = estimates[(1, accum)]
    peaks = [measured[r][accum][0] + measured[r][accum][1] for r in (0, 1)]
    m = min(peaks)  # the ranks hold the same tensors; a late gloo release can only raise one for a moment
    assert any(measured[r][accum][2] for r in (0, 1)), measured  # at least one rank's replay is exact
    assert abs(e.peak_bytes - m) <= 0.005 * m, (accum, e.peak_bytes, peaks, e.breakdown)


def test_no_sync_accumulation_is_what_fsdp2_misses(measured, estimates):
    """With accumulation, FSDP1 keeps every unit's unsharded gradient between micro-batches: the FSDP2 estimate of
    the same run is far under the measured FSDP1 rank (the issue's 14-38% class: 14.6% here), the FSDP1 estimate is
    not; and the rise from no accumulation is the whole model's unsharded fp32 gradient (the peak, at the start of
    a backward, held no gradient without accumulation; 4 B more: the scaled loss)."""
    m = {a: min(measured[r][a][0] + measured[r][a][1] for r in (0, 1)) for a in ACCUM}
    under = (m[2] - estimates[(2, 2)].peak_bytes) / m[2]
    assert under > 0.10, (under, m, estimates[(2, 2)].peak_bytes)
    grads = 4 * sum(p.numel() for p in tiny_llama().parameters())  # fp32, the whole model
    rise = estimates[(1, 2)].peak_bytes - estimates[(1, 1)].peak_bytes
    assert 0 <= rise - grads <= 64, (rise, grads)
    # a third micro-batch (the second under no_sync) adds nothing: the gradients are already full size
    assert estimates[(1, 3)].peak_bytes == estimates[(1, 2)].peak_bytes


def test_fsdp1_notes_state_the_defaults(estimates):
    notes = " ".join(estimates[(1, 2)].notes)
    for fact in ("FULL_SHARD", "BACKWARD_PRE", "limit_all_gathers=True", "no_sync", "root"):
        assert fact in notes, fact
    assert "FSDP2" not in " ".join(estimates[(1, 1)].notes).replace("FSDP2 per-rank", "")


@pytest.mark.parametrize("bad", [3, 0, "1", True, 1.0, None])
def test_bad_fsdp_version_is_refused_the_same_by_every_route(bad):
    want = f"fsdp_version={bad!r} is invalid; allowed: 1 (FSDP1"
    with pytest.raises(ValueError) as api:
        estimate_training_memory("llama-2-7b", batch_size=1, seq_len=8, world_size=2, zero_stage=3, fsdp_version=bad)
    with pytest.raises(ValueError) as mk:
        make_step(batch_size=1, seq_len=8, world_size=2, zero_stage=3, fsdp_version=bad)
    with pytest.raises(ValueError) as spec:
        StepSpec(batch_size=1, seq_len=8, world_size=2, zero_stage=3, fsdp_version=bad)
    assert str(api.value) == str(mk.value) == str(spec.value) and str(api.value).startswith(want), str(api.value)


def test_fsdp1_needs_stage_3():
    with pytest.raises(ValueError, match=r"fsdp_version=1 is invalid with zero_stage=2.*allowed: zero_stage=3"):
        make_step(batch_size=1, seq_len=8, world_size=2, zero_stage=2, fsdp_version=1)


def test_cli_fsdp_version(capsys, tmp_path):
    from memlab.cli.estimate import main

    tiny_llama_config().save_pretrained(tmp_path)
    model = str(tmp_path / "config.json")
    assert main([model, "--batch-size", "2", "--seq-len", "32", "--dtype", "fp32", "--device", "cpu",
                 "--loss", "memlab", "--world-size", "2", "--zero-stage", "3", "--fsdp-version", "1",
                 "--grad-accum", "2", "--no-extrapolate", "--no-suggest"]) == 0
    out = capsys.readouterr().out
    assert "traced with FSDP1" in out and "no_sync" in out
    for bad in ("3", "x", "1.0"):
        with pytest.raises(SystemExit) as exc:
            main([model, "--world-size", "2", "--zero-stage", "3", "--fsdp-version", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        shown = repr(int(bad)) if bad.isdigit() else repr(bad)
        assert f"--fsdp-version={shown} is invalid; allowed: 1 (FSDP1" in err, err
    assert main([model, "--fsdp-version", "1", "--no-suggest"]) == 2
    assert "fsdp_version=1 is invalid with zero_stage=0" in capsys.readouterr().err


@pytest.mark.parametrize("accum", (1, 2))
def test_modelled_fallback_is_a_close_upper_bound_of_the_fsdp1_trace(estimates, accum):
    """Where FSDP1 cannot be traced (torch.distributed already initialised in the process), its units are
    modelled on the single-rank trace (shard_estimate(..., fsdp_version=1)): on the 4-layer tiny Llama 1.8% (no
    accumulation) and 1.1% (2 micro-batches, no_sync) over the trace, which the allocator confirmed above; on
    Qwen2.5-0.5B (8 ranks, 1 x 512, bf16-mixed, CUDA target) 1.5% and 2.0% (4 micro-batches) over, measured
    once by hand."""
    from memlab.estimate import fsdp_units, shard_estimate

    cfg = tiny_llama_config()
    base = estimate_training_memory(cfg, grad_accum=accum, **KW)
    fb = shard_estimate(base, 2, 3, units=fsdp_units(cfg, "fp32"), fsdp_version=1, grad_accum=accum)
    traced = estimates[(1, accum)].peak_bytes
    assert 0 <= fb.peak_bytes - traced <= 0.03 * traced, (fb.peak_bytes, traced)
    assert "FSDP1's unsharded units modelled" in " ".join(fb.notes)
    assert ("no_sync" in " ".join(fb.notes)) == (accum > 1)


@pytest.fixture(scope="module")
def measured_checkpointing():
    return D.launch(_fsdp1_rank, 2, None, True, timeout=600)


@pytest.mark.parametrize("accum", (1, 2))
def test_fsdp1_with_checkpointing_matches_the_allocator(measured_checkpointing, accum):
    """FSDP1 over transformers' gradient checkpointing (each decoder layer recomputed in backward, inside its
    unit), measured as above: 8,862,820 B with no accumulation and 11,379,192 B with 2 micro-batches, both ranks;
    the estimate 8,857,756 and 11,364,000 B (0.06% and 0.13% under)."""
    e = estimate_training_memory(tiny_llama_config(), world_size=2, zero_stage=3, fsdp_version=1, grad_accum=accum,
                                 checkpointing=True, **KW)
    peaks = [measured_checkpointing[r][accum][0] + measured_checkpointing[r][accum][1] for r in (0, 1)]
    assert any(measured_checkpointing[r][accum][2] for r in (0, 1)), measured_checkpointing
    assert abs(e.peak_bytes - min(peaks)) <= 0.005 * min(peaks), (accum, e.peak_bytes, peaks)


@pytest.fixture(scope="module")
def measured_lora():
    return D.launch(_fsdp1_rank, 2, "lora", timeout=600)


@pytest.mark.parametrize("accum", (1, 2))
def test_lora_under_fsdp1_matches_the_allocator(measured_lora, accum):
    """LoRA under FSDP1 needs use_orig_params=True (frozen and trained weights share a flat parameter): traced so
    (FSDP1's warning about it turned into a note), against two gloo ranks measured by the allocator as above.
    With use_orig_params each rank's optimizer holds state for the pieces of the trained weights in its shard, so
    the ranks differ (measured: rank 0 holds 4,142,608 B at the start of a step, rank 1 4,298,208 B); the trace is
    rank 0's: 8,387,032 B measured with no accumulation, 11,882,972 B with 2 micro-batches (no_sync); the estimate
    112 B under the latter."""
    import warnings

    cfg = tiny_llama_config()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        e = estimate_training_memory(cfg, world_size=2, zero_stage=3, fsdp_version=1, grad_accum=accum,
                                     adapter="lora", **KW)
    assert "frozen weights included" in " ".join(e.notes)
    held, rise, closed = measured_lora[0][accum]  # rank 0, the rank the trace is
    assert closed, measured_lora
    assert abs(e.peak_bytes - (held + rise)) <= 0.005 * (held + rise), (accum, e.peak_bytes, held + rise)


def test_fsdp1_accumulation_by_depth_equals_every_layer_traced():
    """FSDP1 with accumulation on 8 layers, extrapolate="auto", equals the trace of every layer to the byte in every
    phase. (Today it is that trace: the FSDP route's extrapolation from 3, 4 and 5 layers finds the synced backward's
    first maximum at another moment at 3 layers than from 4 on, and falls back; a faster route must keep this.)"""
    cfg = tiny_llama_config(num_hidden_layers=8)
    kw = dict(KW, world_size=2, zero_stage=3, fsdp_version=1, grad_accum=2)
    ext = estimate_training_memory(cfg, **{**kw, "extrapolate": "auto"})
    full = estimate_training_memory(cfg, **kw)
    assert (ext.peak_bytes, ext.peak_phase, ext.breakdown) == (full.peak_bytes, full.peak_phase, full.breakdown)
    assert ext.phase_peaks == full.phase_peaks


def test_fsdp1_refuses_two_dtypes_in_one_unit_by_name():
    """fp32 adapters on a bf16 base in one flat parameter: FSDP1 itself refuses it; memlab names the settings."""
    with pytest.raises(ValueError, match=r"fsdp_version=1 is invalid with parameters of two dtypes.*allowed: "
                                         r"adapter_dtype equal"):
        estimate_training_memory(tiny_llama_config(), world_size=2, zero_stage=3, fsdp_version=1, adapter="lora",
                                 adapter_dtype="fp32", **{**KW, "dtype": "bf16-pure"})
