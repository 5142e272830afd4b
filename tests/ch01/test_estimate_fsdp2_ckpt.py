"""memlab estimate --zero-stage 3 (FSDP2) with checkpointing against two gloo ranks measured by the CPU allocator.

Issue 38 asked whether the FSDP2 trace applies checkpointing at all: on Llama-2-7B (8 ranks, 1 x 2048, bf16-mixed,
checkpointing) its forward holds 14.95 GiB of activations where FSDP1's holds 2.98 GiB, while without checkpointing
the two agree. It does, and the real run holds the same. The difference is ``torch.autocast``'s cast cache: under
autocast (``cache_enabled=True``, the default) the bf16 copy of an fp32 parameter that is a leaf, requires grad and
is not a view is kept until the outermost autocast region exits (torch's autocast_mode.cpp, ``cached_cast``).
FSDP2's all-gathered parameter is such a tensor (``FSDPParam.init_unsharded_param`` makes an ``nn.Parameter``, a
leaf, from the all-gather output), so every unit's bf16 weights stay cached through the whole forward although FSDP2
frees the fp32 gathered copy after each unit. FSDP1 (``use_orig_params=False``) hands the modules views of its flat
parameter (not leaves), which autocast does not cache. Without checkpointing both keep those bf16 weights anyway:
each linear saves its cast weight for backward.

Measured: two gloo processes on this CPU, each sharding the tiny Llama with ``fully_shard`` on every decoder layer and
the root (memlab.distributed.fsdp2_shard) after transformers' ``gradient_checkpointing_enable()`` (the estimator's
order: estimate.trace._build_model), AdamW, 2 x 32 tokens per rank, the step as the estimator runs it (autocast over
the forward and the loss). A rank's bytes are what it holds when the counted window starts (the parameters' shards,
the buffers, the optimizer state, the batch: each storage once) plus the CPU allocator's rise over the window,
replayed from torch.profiler's memory events (memlab.profiler.allocator_peak). Two windows: the model's forward
alone (the estimate's forward phase) and the whole step after ``zero_grad``.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from memlab import distributed as D
from memlab.estimate import estimate_training_memory
from memlab.models import tiny_llama, tiny_llama_config

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

BATCH, SEQ = 2, 32  # per rank; the default tiny Llama (4 layers)
KW = dict(batch_size=BATCH, seq_len=SEQ, optimizer="adamw", device="cpu", loss="memlab", extrapolate=False)
# (FSDP version, recipe, autocast's cast cache): all with checkpointing
RUNS = ((2, "bf16-mixed", True), (2, "bf16-mixed", False), (2, "fp32", True), (1, "bf16-mixed", True),
        (1, "bf16-mixed", False))


def _local(t):
    return t.to_local() if callable(getattr(t, "to_local", None)) else t


def _held(model, opt, batch) -> int:
    """Bytes alive at the start of a window (after zero_grad): each storage once."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flat = [m._handle.flat_param for m in FSDP.fsdp_modules(model) if m._handle is not None]
    tensors = [_local(p) for p in model.parameters()] + flat + list(model.buffers()) + list(batch)
    tensors += [_local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [_local(v) for st in opt.state.values() for v in st.values()]
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _rank(rank: int, world_size: int, tries: int = 6) -> dict:
    """Per run of RUNS: (forward window's peak, bytes the forward left alive, whole step's peak, step closed) over
    ``tries`` windows: the lowest peaks (a late gloo release can only raise a window), the bytes left alive as most
    windows saw them."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from memlab.profiler import allocator_peak

    out = {}
    for version, recipe, cache in RUNS:
        torch.manual_seed(0)
        model = tiny_llama()
        model.gradient_checkpointing_enable()  # before the sharding, as the estimator does
        if version == 2:
            D.fsdp2_shard(model)
        else:
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
                         device_id=torch.device("cpu"))
        vocab = tiny_llama_config().vocab_size
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        y = torch.randint(0, vocab, (BATCH, SEQ), generator=g)

        def amp():
            return (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache) if recipe == "bf16-mixed"
                    else contextlib.nullcontext())

        def loss_of(logits):
            return F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))  # memlab.models.lm_loss's loss

        def forward_window() -> tuple[int, int]:
            opt.zero_grad(set_to_none=True)
            outs: list = []
            with amp():
                held = _held(model, opt, (x, y))
                peak, end = allocator_peak(lambda: outs.append(model(input_ids=x, use_cache=False).logits))
                loss = loss_of(outs.pop())
            loss.backward()
            opt.step()
            return held + peak, end

        def step() -> None:
            with amp():
                loss = loss_of(model(input_ids=x, use_cache=False).logits)
            loss.backward()
            opt.step()

        opt.zero_grad(set_to_none=True)
        step()  # the optimizer state exists from here on
        windows = [forward_window() for _ in range(tries)]
        # the lowest peak (a late gloo release can only raise one); the bytes left alive as most windows saw them (a
        # block from before the window freed inside it lowers that window's figure: -10,138,112 B in one CI run)
        ends = [w[1] for w in windows]
        fwd = (min(w[0] for w in windows), max(set(ends), key=lambda e: (ends.count(e), e)))
        best, closed = None, False
        for _ in range(2 * tries):
            opt.zero_grad(set_to_none=True)
            held = _held(model, opt, (x, y))
            rise, end = allocator_peak(step)
            done = end == _held(model, opt, (x, y)) - held  # the allocator came back to what the rank holds
            if not closed and (best is None or done or held + rise < best):
                best, closed = held + rise, done
            still_open = torch.tensor([0 if closed else 1])
            dist.all_reduce(still_open)
            if still_open.item() == 0:
                break
        out[(version, recipe, cache)] = (fwd[0], fwd[1], best, closed)
    return out


@pytest.fixture(scope="module")
def measured():
    return D.launch(_rank, 2, timeout=600)


@pytest.fixture(scope="module")
def estimates():
    cfg = tiny_llama_config()
    return {(v, r): estimate_training_memory(cfg, world_size=2, zero_stage=3, fsdp_version=v, dtype=r,
                                             checkpointing=True, **KW)
            for v, r, cache in RUNS if cache}


def _lowest(measured, run, i):
    return min(measured[r][run][i] for r in (0, 1))


@pytest.mark.parametrize("run", [r for r in RUNS if r[2] and r[0] == 2], ids=lambda r: f"fsdp{r[0]}-{r[1]}")
def test_checkpointed_forward_matches_the_allocator(measured, estimates, run):
    """The forward phase's peak traced with FSDP2 over checkpointed layers against the ranks' forward window.
    Measured on this 2-core CPU (torch 2.13, both ranks equal, every try): bf16-mixed 8,442,484 B, fp32
    7,354,996 B; the estimates 8,427,292 and 7,339,804 B (15,192 B under, 0.2%, both). (FSDP1's forward phase is
    not checked here: its trace is 378,712 B (fp32) to 450,392 B (bf16-mixed) under this window on gloo, about
    one layer's shard; FSDP1's step peak, in backward, matches: test_checkpointed_step_matches_the_allocator.)"""
    e = estimates[run[:2]]
    m = _lowest(measured, run, 0)
    assert abs(e.phase_peaks["forward"] - m) <= 0.005 * m, (run, e.phase_peaks["forward"], m)


@pytest.mark.parametrize("run", [r for r in RUNS if r[2]], ids=lambda r: f"fsdp{r[0]}-{r[1]}")
def test_checkpointed_step_matches_the_allocator(measured, estimates, run):
    """The whole step's peak (after zero_grad: the backward's, with its recomputes and re-gathers). Measured:
    FSDP2 bf16-mixed 9,236,148 B, fp32 9,207,476 B, FSDP1 bf16-mixed 8,862,820 B."""
    e = estimates[run[:2]]
    m = _lowest(measured, run, 2)
    assert any(measured[r][run][3] for r in (0, 1)), measured  # at least one rank's replay closed: exact
    assert abs(e.peak_bytes - m) <= 0.005 * m, (run, e.peak_bytes, m)


def _linear_bf16_bytes_of_layers() -> int:
    with torch.device("meta"):
        model = tiny_llama()
    return sum(2 * m.weight.numel() for layer in model.model.layers for m in layer.modules()
               if isinstance(m, torch.nn.Linear))


def test_what_fsdp2_keeps_is_autocasts_cast_cache(measured):
    """The real run, cache on and off: the forward leaves alive, beyond what it leaves with ``cache_enabled=False``,
    exactly the bf16 copy of every decoder layer's linear weights (measured: 1,449,984 B, 4 x 181,248 weights x
    2 B); with the cache off the bf16-mixed forward peaks where the fp32 one does."""
    on, off = (2, "bf16-mixed", True), (2, "bf16-mixed", False)
    for r in (0, 1):
        assert measured[r][on][1] - measured[r][off][1] == _linear_bf16_bytes_of_layers(), measured[r]
    assert _lowest(measured, on, 0) > _lowest(measured, off, 0)
    assert abs(_lowest(measured, off, 0) - _lowest(measured, (2, "fp32", True), 0)) <= 0.005 * _lowest(
        measured, off, 0)


def test_fsdp1_keeps_no_cast_and_fsdp2_does(measured, estimates):
    """FSDP1's modules hold views of its flat parameter, which autocast does not cache: its real forward leaves the
    same bytes alive with the cache on and off (measured 611,104 B both), and holds less than FSDP2's (measured
    1,813,640 B less); both estimates show the same gap (the issue's 7B gap, in small)."""
    for r in (0, 1):
        assert measured[r][(1, "bf16-mixed", True)][1] == measured[r][(1, "bf16-mixed", False)][1], measured[r]
    cache = _linear_bf16_bytes_of_layers()
    real_gap = _lowest(measured, (2, "bf16-mixed", True), 0) - _lowest(measured, (1, "bf16-mixed", True), 0)
    est_gap = estimates[(2, "bf16-mixed")].phase_peaks["forward"] - estimates[(1, "bf16-mixed")].phase_peaks["forward"]
    assert real_gap > cache and est_gap > cache, (real_gap, est_gap, cache)
