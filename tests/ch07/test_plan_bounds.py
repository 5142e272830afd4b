"""memlab.plan's pruning against full traces on a small model (issue 42.2): the lower bound (weights + gradients +
optimizer state) is at or below every traced peak; the memory order behind both the "exceeds" and the "fits"
decisions holds for every pair of candidates it relates; and the pruned planner picks the same stack, with the
same peak, as the exhaustive one (``plan(prune=False)``: every candidate traced) at budgets across the range."""
from __future__ import annotations

import itertools

import pytest

from memlab import plan as P
from memlab.models import tiny_llama_config
from memlab.plan import Stack, bounds
from memlab.plan.search import needs_at_least

SEQ = 16
BATCH = 2
LAYERS = 4  # every-k with k=2 needs k < layers


@pytest.fixture(autouse=True)
def _trace_cache_in_tmp(tmp_path_factory, monkeypatch):
    """The tests' traces persist in a temporary directory, never in the user's cache."""
    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memlab-traces"))


def small_cfg():
    # hidden 64: the 64 x 64 projections are 8-bit AdamW's smallest quantized tensors (4,096 elements)
    return tiny_llama_config(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)


ALLOW = {"precision": ["bf16-mixed", "bf16-pure"]}  # fp32's order is bf16-mixed's (both keep fp32 weights): 72 stacks


def _exhaustive(device, allow=ALLOW):
    # every candidate of the default space (or ``allow``), traced: the exhaustive planner at a budget all fit; for a
    # CUDA target (the planner's default: the reserved estimate, offload-adamw among the optimizers)
    return P.plan(small_cfg(), "1TiB", batch_size=BATCH, seq_len=SEQ, device=device, lora_r=4, host_budget=None,
                  allow=allow, prune=False)


@pytest.fixture(scope="module")
def full_cuda(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MEMLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memlab-traces"))
    try:
        yield _exhaustive("cuda")
    finally:
        mp.undo()


def _peaks(res):
    return {r.stack: r for r in res.rows}


def test_exhaustive_traces_every_candidate(full_cuda):
    assert full_cuda.traces == len(full_cuda.rows) == 72 and not full_cuda.pruned
    assert all(r.status == "traced" for r in full_cuda.rows)
    kinds = {(r.stack.adapter, r.stack.precision, r.stack.optimizer) for r in full_cuda.rows}
    # every adapter, precision and optimizer the bound has a rule for
    assert {k[0] for k in kinds} == {"full", "lora", "qlora"} and {k[2] for k in kinds} >= set(P.stack.OPTIMIZERS)
    assert {r.stack.checkpointing for r in full_cuda.rows} == {"none", "every-k", "full"}


def test_lower_bound_is_at_most_every_traced_peak(full_cuda):
    counts = bounds.param_counts(small_cfg(), 4)
    for r in full_cuda.rows:
        lb = bounds.lower_bound(r.stack, counts, 4)
        assert 0 < lb <= r.peak_bytes, (P.stack_label(r.stack), lb, r.peak_bytes)
    # the bound is the bytes of the weights, gradients and optimizer state, nothing else: an fp32 AdamW full
    # fine-tune holds 4 + 4 + 8 bytes per parameter, a bf16-pure one half that
    n = sum(counts.full)
    assert n == full_cuda.n_params
    assert bounds.lower_bound(Stack(precision="fp32"), counts, 4) == 16 * n
    assert bounds.lower_bound(Stack(precision="bf16-pure"), counts, 4) == 8 * n
    assert bounds.state_bytes(Stack(precision="bf16-pure", optimizer="offload-adamw"), counts, 4) == {
        "weights": 2 * n, "gradients": 0, "optimizer state": 0}


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu", "gpu-target"])  # fake tensors: no GPU needed
def test_lower_bound_with_the_step_in_backward(device):
    """The step in backward frees each gradient once stepped: the bound counts no gradient, only weights and state."""
    cfg, counts = small_cfg(), bounds.param_counts(small_cfg(), 4)
    for prec, opt in itertools.product(("fp32", "bf16-pure"), ("adamw", "adamw8bit")):
        s = Stack(precision=prec, optimizer=opt, checkpointing="full", micro_batch=1, optimizer_in_backward=True)
        est = P.estimate_stack(cfg, s, seq_len=SEQ, device=device, lora_r=4)
        need = est.reserved_bytes if device == "cuda" else est.peak_bytes
        assert bounds.state_bytes(s, counts, 4)["gradients"] == 0
        assert bounds.lower_bound(s, counts, 4) <= est.peak_bytes <= need, P.stack_label(s)


def test_the_memory_order_holds_for_every_pair(full_cuda):
    """needs_at_least(c, d) -> c's traced peak >= d's, for every pair of candidates it relates (the rule that
    rules out above a stack that does not fit); fits_by_neighbour(d, c) -> d fits whenever c does, host
    memory included (the rule that decides "fits" untraced)."""
    rows = _peaks(full_cuda)
    pairs = used = 0
    for c, d in itertools.permutations(rows, 2):
        if needs_at_least(c, d, LAYERS):
            pairs += 1
            assert rows[c].peak_bytes >= rows[d].peak_bytes, (P.stack_label(c), P.stack_label(d))
        if bounds.fits_by_neighbour(d, c, LAYERS):
            used += 1
            assert rows[c].peak_bytes >= rows[d].peak_bytes and rows[c].host_bytes == rows[d].host_bytes
    assert pairs > 100 and used > 100  # the order relates many pairs here, every-k and accumulation included


@pytest.mark.parametrize("prefer", ["fidelity", "cost"])
def test_pruned_plan_equals_the_exhaustive_one(full_cuda, prefer):
    """At budgets across the range of peaks: the same pick with the same peak as the exhaustive planner, every
    untraced decision right, and fewer traces."""
    rows = _peaks(full_cuda)
    peaks = sorted({r.peak_bytes for r in rows.values()})
    counts = bounds.param_counts(small_cfg(), 4)
    smallest_lb = min(bounds.lower_bound(s, counts, 4) for s in rows)
    below = above = 0
    for budget in (smallest_lb - 1, peaks[0] - 1, peaks[len(peaks) // 10], peaks[len(peaks) // 3], peaks[len(peaks) // 2],
                   peaks[-1]):
        kw = dict(batch_size=BATCH, seq_len=SEQ, device="cuda", lora_r=4, host_budget=None, prefer=prefer, allow=ALLOW)
        full = P.plan(small_cfg(), budget, prune=False, **kw)
        pruned = P.plan(small_cfg(), budget, **kw)
        if full.pick is None:
            assert pruned.pick is None
        else:
            assert pruned.pick is not None and pruned.pick.stack == full.pick.stack, budget
            assert pruned.pick.peak_bytes == full.pick.peak_bytes and pruned.pick.status == "traced"
        for r in pruned.rows:
            truth = rows[r.stack].peak_bytes
            if r.status == "traced":
                assert r.peak_bytes == truth
            elif r.status == "fits":
                assert truth <= r.upper_bytes <= budget
            elif r.status == "exceeds":
                assert truth > budget and (r.lower_bytes is None or r.lower_bytes <= truth)
        assert pruned.traces < full.traces and pruned.fresh == 0  # every trace it took, the exhaustive one took
        below, above = below + pruned.below, above + pruned.above
    assert below > 0  # the lower bound decided stacks on the way (and, ranked by fidelity, a traced neighbour too)
    assert above > 0 or prefer == "cost"


def test_summary_counts_fresh_traces_and_cache_hits_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path / "cache"))
    P.stacks._CACHE.clear()
    kw = dict(batch_size=BATCH, seq_len=SEQ, device="cpu", lora_r=4, allow={"adapter": ["full"], "precision": ["fp32"],
                                                                         "optimizer": ["adamw"]})
    first = P.plan(small_cfg(), "64MiB", **kw)
    assert first.fresh == first.traces > 0 and first.cached == 0
    assert f"{first.fresh} stacks traced on fake tensors, 0 read from the trace cache" in first.summary
    P.stacks._CACHE.clear()  # a new process: the disk cache only
    again = P.plan(small_cfg(), "64MiB", **kw)
    assert again.fresh == 0 and again.cached == first.traces
    assert f"0 stacks traced on fake tensors, {first.traces} read from the trace cache" in again.summary
