"""memlab.plan's first run made cheaper (issue 42.2) without changing a row: the accumulation bound
(:func:`memlab.plan.bounds.accumulation_lower_bound`: a stack of one micro-batch per step needs at least an
accumulating stack's traced tensor peak less the gradients that stack keeps between micro-batches) is at or below
the traced peak of every stack it bounds, over every pair of traced candidates it relates; the plans it prunes keep
the exhaustive planner's pick and every decision right; and tracing ahead in a second process
(:mod:`memlab.plan.ahead`) changes no row and no count of the plan, only who traced."""
from __future__ import annotations

import itertools

import pytest

from memlab import plan as P
from memlab.models import tiny_llama_config
from memlab.plan import bounds
from memlab.plan.ahead import ahead_possible

SEQ = 16
BATCH = 4  # micro-batches 1, 2, 4: every one-micro-batch stack (4x1) against two accumulating ones (1x4, 2x2)
LAYERS = 4
# every adapter, both 16-bit recipes, an optimizer of each kind of state (fused AdamW's is AdamW's), every kind of
# checkpointing: 72 stacks on a CUDA target, 54 on a CPU (no offload)
ALLOW = {"precision": ["bf16-mixed", "bf16-pure"], "optimizer": ["adamw", "adamw8bit", "offload-adamw"]}


@pytest.fixture(autouse=True)
def _trace_cache_in_tmp(tmp_path_factory, monkeypatch):
    """The tests' traces persist in a temporary directory, never in the user's cache."""
    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memlab-traces-speed"))


def small_cfg():
    return tiny_llama_config(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)


def _plan(budget, device="cuda", **kw):
    return P.plan(small_cfg(), budget, batch_size=BATCH, seq_len=SEQ, device=device, lora_r=4, host_budget=None,
                  allow=ALLOW, **kw)


@pytest.fixture(scope="module", params=["cuda", "cpu"], ids=["gpu-target", "cpu"])
def exhaustive(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MEMLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memlab-traces-speed"))
    try:
        yield request.param, _plan("1TiB", device=request.param, prune=False)
    finally:
        mp.undo()


def test_accumulation_bound_is_at_most_every_traced_peak(exhaustive):
    """For every pair (c, d) with c one micro-batch per step and d accumulating, otherwise in the memory order: the
    bound from d's traced tensor peak is at or below c's traced tensor peak (so below its reserved estimate too)."""
    device, res = exhaustive
    rows = {r.stack: r for r in res.rows}
    assert len(rows) == res.traces and all(r.status == "traced" for r in rows.values())
    counts = bounds.param_counts(small_cfg(), 4)
    pairs, kinds = 0, set()
    for c, d in itertools.permutations(rows, 2):
        if not bounds.needs_at_least_less_kept(c, d, LAYERS):
            continue
        pairs += 1
        kinds.add((d.adapter, d.optimizer, d.checkpointing))
        lb = bounds.accumulation_lower_bound(d, rows[d].tensor_peak_bytes, counts, 4)
        assert lb <= rows[c].tensor_peak_bytes <= rows[c].peak_bytes, (P.stack_label(c), P.stack_label(d), lb,
                                                                         rows[c].tensor_peak_bytes)
        # the only order it adds: the memory order itself never relates these two
        assert not bounds.needs_at_least(c, d, LAYERS)
    # every adapter, optimizer and checkpointing the planner has is among the pairs checked
    assert pairs > 50
    assert {k[0] for k in kinds} == {"full", "lora", "qlora"}
    assert {k[1] for k in kinds} == {"adamw", "adamw8bit"} | ({"offload-adamw"} if device == "cuda" else set())
    assert {k[2] for k in kinds} == {"none", "every-k", "full"}


def test_kept_gradients_are_the_trainable_parameters_gradients():
    counts = bounds.param_counts(small_cfg(), 4)
    full = P.Stack(precision="bf16-mixed", micro_batch=1, grad_accum=4)
    assert bounds.kept_gradient_bytes(full, counts, 4) == 4 * sum(counts.full)  # fp32 master weights' gradients
    assert bounds.kept_gradient_bytes(P.Stack(precision="bf16-pure", micro_batch=1, grad_accum=4), counts, 4) == \
        2 * sum(counts.full)
    lora = P.Stack(precision="bf16-mixed", adapter="lora", optimizer="adamw", micro_batch=2, grad_accum=2)
    assert bounds.kept_gradient_bytes(lora, counts, 4) == 4 * sum(counts.adapters)  # fp32 adapters
    assert bounds.kept_gradient_bytes(P.Stack(precision="bf16-mixed", micro_batch=4), counts, 4) == 0
    # offloaded: counted all the same (more than the device keeps: the bound stays below)
    assert bounds.kept_gradient_bytes(P.Stack(precision="bf16-mixed", optimizer="offload-adamw", grad_accum=4),
                                      counts, 4) == 4 * sum(counts.full)


def test_pruned_plans_decide_by_the_accumulation_bound_rightly(exhaustive):
    """At budgets across the range: the exhaustive planner's pick and peak, every untraced decision right, and some
    one-micro-batch stacks ruled out by the accumulation bound (their ``lower_bytes`` at most their traced peak)."""
    device, res = exhaustive
    truth = {r.stack: r for r in res.rows}
    counts = bounds.param_counts(small_cfg(), 4)
    # just below the bound of pairs it relates (there the accumulating stack exceeds and the bound decides), and a few
    # budgets across the range of peaks
    lbs = sorted({bounds.accumulation_lower_bound(d, truth[d].tensor_peak_bytes, counts, 4) - 1
                  for c, d in itertools.permutations(truth, 2) if bounds.needs_at_least_less_kept(c, d, LAYERS)})
    peaks = sorted({r.peak_bytes for r in truth.values()})
    decided = 0
    for budget in lbs[::max(1, len(lbs) // 6)] + [peaks[int(q * len(peaks))] for q in (0.1, 0.3, 0.6)]:
        full = _plan(budget, device=device, prune=False)
        pruned = _plan(budget, device=device)
        assert (pruned.pick is None) == (full.pick is None)
        if full.pick is not None:
            assert pruned.pick.stack == full.pick.stack and pruned.pick.peak_bytes == full.pick.peak_bytes
        for r in pruned.rows:
            t = truth[r.stack]
            if r.status == "traced":
                assert r.peak_bytes == t.peak_bytes and r.tensor_peak_bytes == t.tensor_peak_bytes
            elif r.status == "exceeds":
                assert t.peak_bytes > budget
                if "less the gradients it keeps" in r.notes:
                    decided += 1
                    assert budget < r.lower_bytes <= t.tensor_peak_bytes, P.stack_label(r.stack)
            elif r.status == "fits":
                assert t.peak_bytes <= r.upper_bytes <= budget
    assert decided > 0


def _busy_budget(device):
    # the smallest traced peak at which the pruned plan traces five stacks or more (read from the shared trace cache)
    peaks = sorted({r.peak_bytes for r in _plan("1TiB", device=device, prune=False).rows})
    return next(b for b in peaks if _plan(b, device=device).traces >= 5)


def _rows(res):
    return [(r.stack, r.status, r.peak_bytes, r.fits, r.lower_bytes, r.upper_bytes, r.notes) for r in res.rows]


@pytest.mark.skipif(not ahead_possible(), reason="tracing ahead needs Linux's fork and two CPUs")
@pytest.mark.parametrize("device", ["cuda", "cpu"], ids=["gpu-target", "cpu"])
def test_tracing_ahead_changes_no_row(tmp_path, monkeypatch, device):
    """The same plan with and without a second process, each from an empty trace cache: the same rows (peaks, fits,
    notes) and counts; with it, some traces were made ahead and every one of them was asked for or counted unused."""
    budget = _busy_budget(device)
    plans = {}
    for ahead in ("0", "1"):
        monkeypatch.setenv("MEMLAB_PLAN_AHEAD", ahead)
        monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path / f"cache-{ahead}"))
        P.stacks._CACHE.clear()
        plans[ahead] = _plan(budget, device=device)
    one, two = plans["0"], plans["1"]
    assert _rows(one) == _rows(two)
    assert (one.fresh, one.cached, one.below, one.above) == (two.fresh, two.cached, two.below, two.above)
    assert one.fresh >= 4 and one.ahead == one.ahead_unused == 0
    assert two.ahead > 0 and f"{two.ahead} of the traces made ahead" in two.summary
    assert f"{two.fresh} stacks traced on fake tensors, 0 read from the trace cache" in two.summary
    # what was traced ahead and asked for is in the trace cache: a third run traces nothing
    P.stacks._CACHE.clear()
    again = _plan(budget, device=device)
    assert again.fresh == 0 and again.cached == two.traces and _rows(again) == _rows(two)


@pytest.mark.skipif(not ahead_possible(), reason="tracing ahead needs Linux's fork and two CPUs")
def test_a_failing_second_process_changes_nothing(tmp_path, monkeypatch):
    """A child that fails sends its error; the stack is traced here instead: the same rows and counts."""
    from memlab.plan import ahead

    budget = _busy_budget("cuda")
    monkeypatch.setenv("MEMLAB_PLAN_AHEAD", "0")
    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path / "serial"))
    P.stacks._CACHE.clear()
    serial = _plan(budget)

    def failing(fn, stack, conn):
        conn.send(("error", "RuntimeError('a child that fails')"))
        conn.close()

    monkeypatch.setattr(ahead, "_child", failing)
    monkeypatch.setenv("MEMLAB_PLAN_AHEAD", "1")
    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path / "failing"))
    P.stacks._CACHE.clear()
    res = _plan(budget)
    assert _rows(res) == _rows(serial) and res.fresh == serial.fresh and res.cached == serial.cached


def test_ahead_is_off_when_asked(monkeypatch):
    monkeypatch.setenv("MEMLAB_PLAN_AHEAD", "off")
    assert not ahead_possible()
