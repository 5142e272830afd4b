"""Plausible wrong answers to chapter 07's exercises; tests/course/test_mutants.py asserts each FAILS its check.

MUTANTS maps an exercise id to (name, wrong implementation) pairs.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from os import replace  # a right answer below calls the name bound here at import time
from pathlib import Path

from memlab import train
from memlab.plan import Stack


# ----------------------------------------------------------------------------- 07.cheapest_stack
def _candidates(eb, micro_batches=None, modes=("none", "full")):
    ms = micro_batches if micro_batches is not None else [d for d in range(eb, 0, -1) if eb % d == 0]
    return [Stack(micro_batch=m, grad_accum=eb // m, checkpointing=c) for m in ms for c in modes]


def _best(cands, budget, estimate, cost, fits=lambda p, b: p <= b, key=None):
    ok = [(s, estimate(s)) for s in cands if fits(estimate(s), budget)]
    if not ok:
        return None
    key = key or (lambda sp: (cost(sp[0]), sp[1]))
    return min(ok, key=key)[0]


def plan_strict_budget(eb, budget, estimate, cost):
    """``<`` instead of ``<=``: a stack that needs exactly the budget is thrown away."""
    return _best(_candidates(eb), budget, estimate, cost, fits=lambda p, b: p < b)


def plan_smallest_peak(eb, budget, estimate, cost):
    """Picks the stack that needs the least memory, not the cheapest one that fits."""
    return _best(_candidates(eb), budget, estimate, cost, key=lambda sp: (sp[1], cost(sp[0])))


def plan_powers_of_two(eb, budget, estimate, cost):
    """Halves the micro-batch from the effective batch: misses divisors such as 3, 6 and 9."""
    ms, m = [], eb
    while m >= 1:
        if eb % m == 0:
            ms.append(m)
        m //= 2
    return _best(_candidates(eb, ms), budget, estimate, cost)


def plan_no_checkpointing(eb, budget, estimate, cost):
    """Forgets checkpointing: only micro-batch x accumulation."""
    return _best(_candidates(eb, modes=("none",)), budget, estimate, cost)


def plan_first_fit(eb, budget, estimate, cost):
    """Returns the first candidate that fits (the biggest micro-batch), whatever it costs."""
    for s in _candidates(eb):
        if estimate(s) <= budget:
            return s
    return None


def plan_ties_to_larger_peak(eb, budget, estimate, cost):
    """Equal costs go to the larger estimated peak."""
    return _best(_candidates(eb), budget, estimate, cost, key=lambda sp: (cost(sp[0]), -sp[1]))


def plan_any_micro_batch(eb, budget, estimate, cost):
    """Every micro-batch from eb down to 1, grad_accum = eb // m: 3 x 2 trains on 6 sequences, not 8."""
    cands = [Stack(micro_batch=m, grad_accum=eb // m, checkpointing=c) for m in range(eb, 0, -1) for c in ("none", "full")]
    return _best(cands, budget, estimate, cost)


def plan_ceil_accum(eb, budget, estimate, cost):
    """Every micro-batch, grad_accum = ceil(eb / m): 3 x 3 trains on 9 sequences, not 8."""
    cands = [Stack(micro_batch=m, grad_accum=-(-eb // m), checkpointing=c) for m in range(eb, 0, -1)
             for c in ("none", "full")]
    return _best(cands, budget, estimate, cost)


def plan_smallest_first(eb, budget, estimate, cost):
    """Divisors smallest first: on equal costs and peaks the earlier candidate is the wrong one."""
    return _best(_candidates(eb, sorted(d for d in range(1, eb + 1) if eb % d == 0)), budget, estimate, cost)


def plan_full_first(eb, budget, estimate, cost):
    """Checkpointing "full" before "none" in the candidate order."""
    return _best(_candidates(eb, modes=("full", "none")), budget, estimate, cost)


# ----------------------------------------------------------------------------- 07.back_off
def back_off_naive_halving(stack):
    """micro_batch // 2 even when it does not divide the effective batch (18 -> 9 -> 4: effective 16)."""
    eff = stack.effective_batch
    if stack.micro_batch > 1:
        mb = stack.micro_batch // 2
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    return dataclasses.replace(stack, checkpointing="full") if stack.checkpointing != "full" else None


def back_off_no_accumulation(stack):
    """Halves the micro-batch but keeps grad_accum: the effective batch shrinks."""
    if stack.micro_batch > 1:
        return dataclasses.replace(stack, micro_batch=max(d for d in range(1, stack.micro_batch // 2 + 1)
                                                          if stack.effective_batch % d == 0))
    return dataclasses.replace(stack, checkpointing="full") if stack.checkpointing != "full" else None


def back_off_checkpointing_first(stack):
    """Turns on checkpointing before shrinking the micro-batch."""
    if stack.checkpointing != "full":
        return dataclasses.replace(stack, checkpointing="full")
    if stack.micro_batch > 1:
        eff = stack.effective_batch
        mb = max(d for d in range(1, stack.micro_batch // 2 + 1) if eff % d == 0)
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    return None


def back_off_drops_knobs(stack):
    """Builds a fresh Stack: precision, optimizer, attention and ckpt_every fall back to the defaults."""
    nxt = train.back_off(stack)
    if nxt is None:
        return None
    return Stack(micro_batch=nxt.micro_batch, grad_accum=nxt.grad_accum, checkpointing=nxt.checkpointing)


def back_off_minus_one(stack):
    """The next smaller divisor instead of the largest one at most half: 18 -> 9 -> 6 (expected 3)."""
    eff = stack.effective_batch
    if stack.micro_batch > 1:
        mb = max(d for d in range(1, stack.micro_batch) if eff % d == 0)
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    return dataclasses.replace(stack, checkpointing="full") if stack.checkpointing != "full" else None


def back_off_loops_forever(stack):
    """At the end returns the same stack instead of None: the trainer would retry it forever."""
    return train.back_off(stack) or stack


def back_off_divisor_of_micro_batch(stack):
    """The largest divisor of the micro-batch (not of the effective batch) at most half: 5 x 2 -> 1 x 10 (expected 2 x 5)."""
    eff = stack.effective_batch
    if stack.micro_batch > 1:
        mb = max(d for d in range(1, stack.micro_batch // 2 + 1) if stack.micro_batch % d == 0)
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    return dataclasses.replace(stack, checkpointing="full") if stack.checkpointing != "full" else None


def back_off_ceil_half(stack):
    """At most ceil(micro_batch / 2): 3 x 4 -> 2 x 6 (expected 1 x 12; 2 does not halve the activations)."""
    eff = stack.effective_batch
    if stack.micro_batch > 1:
        mb = max(d for d in range(1, -(-stack.micro_batch // 2) + 1) if eff % d == 0)
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    return dataclasses.replace(stack, checkpointing="full") if stack.checkpointing != "full" else None


def back_off_any_checkpointing_is_enough(stack):
    """At micro-batch 1, any checkpointing ("every-k" too) counts as done: returns None too early."""
    if stack.micro_batch > 1:
        return train.back_off(stack)
    return dataclasses.replace(stack, checkpointing="full") if stack.checkpointing == "none" else None


# ----------------------------------------------------------------------------- 07.atomic_write
def write_in_place(path, chunks):
    """Writes straight into the file: a kill leaves it torn."""
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())


def write_no_fsync(path, chunks):
    """Temp file + rename, but no fsync: after a power cut the rename may land without the data."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_temp_elsewhere(path, chunks):
    """The temp file in the system temp directory: the rename crosses directories (file systems)."""
    fd, tmp = tempfile.mkstemp()
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(Path(path).parent, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def write_no_dir_fsync(path, chunks):
    """Everything but the directory fsync: the new name itself may be lost on a power cut."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_rename_then_fsync(path, chunks):
    """Renames first, fsyncs after: the order that lets a crash publish an empty file."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        f = open(tmp, "wb")
        for c in chunks:
            f.write(c)
        f.flush()
        os.replace(tmp, path)
        os.fsync(f.fileno())
        f.close()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_leaves_temp_on_error(path, chunks):
    """Right order, but an error leaves the half-written temp file behind."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "wb") as f:
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_truncate_then_rename(path, chunks):
    """Empties the target first ("to make room"), then writes the temp file and renames it."""
    path = Path(path)
    open(path, "wb").close()
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_move_old_away(path, chunks):
    """Keeps a backup: moves the good file aside, writes the new one, restores the backup on an error.
    Right on errors, wrong on a kill: between the two renames there is no file under the name."""
    path = Path(path)
    bak = path.with_name(path.name + ".bak")
    tmp = path.with_name("." + path.name + ".tmp")
    had_old = path.exists()
    if had_old:
        os.replace(path, bak)
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        if had_old:
            os.replace(bak, path)
        raise
    if had_old:
        bak.unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_fsync_before_writing(path, chunks):
    """fsyncs the temp file as soon as it is opened, then writes: the fsync made nothing durable."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            os.fsync(f.fileno())
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_fsync_without_flush(path, chunks):
    """os.fsync(f.fileno()) without f.flush(): the bytes still in Python's buffer are not on disk yet."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_fsyncs_cwd(path, chunks):
    """fsyncs the current directory (os.open(".")) after the rename, not the target's directory."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(".")


def write_fsyncs_dir_before_rename(path, chunks):
    """fsyncs the directory before the rename: the new name is still not durable."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(path.parent)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- 07.predict_peak
# Each wrong derivation below is the exact formula with one term forgotten or miscounted (sizes measured on the
# graded cases: 2-core x86_64 CPU, torch 2.13.0+cpu); and two traces, which the check refuses to run.
def _derive(model_fn, stack, seq_len, *, counters=True, labels=True, masks=True, accum_grads=True, denom=True,
            scalars=True, ids_batch=None, act_batch=None, logsumexp=True, ln_stats=True, ratio=None, vocab=None,
            length=None, heads=None):
    cfg = model_fn().config
    V, bs, L, a, h = vocab or cfg.vocab_size, cfg.block_size, cfg.n_layer, heads or cfg.n_head, cfg.n_embd
    r = ratio or cfg.mlp_ratio
    seq_len = length(cfg, seq_len) if length else seq_len
    mb, ga, s, f = stack.micro_batch, stack.grad_accum, seq_len, 4
    E = ids_batch or stack.effective_batch
    m = act_batch or mb
    sizes = [V * h, bs * h] + L * [h, h, 3 * h * h, 3 * h, h * h, h, h, h, r * h * h, r * h, r * h * h, h] + [h, h]
    n = sum(sizes)
    weights = f * n + (L * bs * bs if masks else 0)
    adam = 2 * f * n + (4 * len(sizes) if counters else 0)
    ids = 8 * E * s * (2 if labels else 1)
    per_block = m * s * ((8 + 2 * r) * f * h + (f * a if logsumexp else 0) + (4 * f if ln_stats else 0))
    head = m * s * (3 * f * V + 2 * f * h + 8) + 8 * s + (4 if scalars else 0)
    losses = (4 if ga == 1 else 12 if ga == 2 else 16) if scalars else 0
    backward = weights + adam + ids + L * per_block + head + losses + (f * n if ga > 1 and accum_grads else 0)
    temp = f * max(2 * k + (sizes[i - 1] if i and denom else 0) for i, k in enumerate(sizes))
    optimizer = weights + f * n + adam + ids + temp + (4 if scalars else 0)
    return max(backward, optimizer)


def predict_no_step_counters(model_fn, stack, seq_len):
    """AdamW's two moments per element, but not its 4-byte step counter per tensor (-112 / -160 B)."""
    return _derive(model_fn, stack, seq_len, counters=False)


def predict_forgets_labels(model_fn, stack, seq_len):
    """The input ids x but not the labels y (-8 x effective_batch x seq_len: -64 B to -2 KiB)."""
    return _derive(model_fn, stack, seq_len, labels=False)


def predict_forgets_mask_buffers(model_fn, stack, seq_len):
    """Parameters only: each block's bool causal mask (block_size^2 B) left out (-2 KiB / -12 KiB)."""
    return _derive(model_fn, stack, seq_len, masks=False)


def predict_without_accumulated_grads(model_fn, stack, seq_len):
    """The last micro-batch's backward without the gradients accumulation keeps alive (-4 B x parameters)."""
    return _derive(model_fn, stack, seq_len, accum_grads=False)


def predict_forgets_previous_denom(model_fn, stack, seq_len):
    """AdamW's two temporaries, but not the previous tensor's denom still referenced (-1 KiB when the step peaks)."""
    return _derive(model_fn, stack, seq_len, denom=False)


def predict_forgets_loss_scalars(model_fn, stack, seq_len):
    """The 0-d losses (the loss, loss / k, the running sum, the last detached loss) left out (-4 to -16 B)."""
    return _derive(model_fn, stack, seq_len, scalars=False)


def predict_micro_batch_ids_only(model_fn, stack, seq_len):
    """Token ids of one micro-batch alive, not of the whole effective batch."""
    return _derive(model_fn, stack, seq_len, ids_batch=stack.micro_batch)


def predict_effective_batch_activations(model_fn, stack, seq_len):
    """Activations of the whole effective batch at once (ignores the micro-batching)."""
    return _derive(model_fn, stack, seq_len, act_batch=stack.effective_batch)


def predict_forgets_logsumexp(model_fn, stack, seq_len):
    """SDPA saves its output but not its per-head logsumexp (-4 B x heads x tokens per block)."""
    return _derive(model_fn, stack, seq_len, logsumexp=False)


def predict_forgets_layernorm_stats(model_fn, stack, seq_len):
    """LayerNorm's inputs saved, its per-row mean and rstd not (-16 B x tokens per block)."""
    return _derive(model_fn, stack, seq_len, ln_stats=False)


def predict_formula_16_bytes(model_fn, stack, seq_len):
    """16 bytes per parameter (weights, gradients, two Adam moments) and no activations."""
    return 16 * sum(p.numel() for p in model_fn().parameters())


def predict_by_fake_trace(model_fn, stack, seq_len):
    """Right to the byte, but a trace (memlab's FakeTensorMode estimator), not a derivation."""
    return train.estimate_stack_peak(model_fn, stack, seq_len)


def predict_on_meta_device(model_fn, stack, seq_len):
    """A forward on the meta device to read the activation sizes off: a trace too."""
    import torch

    model = model_fn().to("meta")
    x = torch.zeros(stack.micro_batch, seq_len, dtype=torch.long, device="meta")
    model(x)
    return _derive(model_fn, stack, seq_len)


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
# (constants tuned to the graded inputs, the input space not covered, state kept across calls)
_GRADED_DIVISORS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 18)


def plan_divisor_table(eb, budget, estimate, cost):
    """Micro-batches from a table of the divisors the graded batches have (1-10, 12, 18): misses 11, 13, 15, ..."""
    ms = sorted({d for d in _GRADED_DIVISORS if eb % d == 0} | {eb}, reverse=True)
    return _best(_candidates(eb, ms), budget, estimate, cost)


def plan_cost_rounded(eb, budget, estimate, cost):
    """Compares costs rounded to one decimal: two stacks 0.05 apart count as a tie, the smaller peak wins."""
    return _best(_candidates(eb), budget, estimate, cost, key=lambda sp: (round(cost(sp[0]), 1), sp[1]))


_PLANS: dict = {}


def plan_memoised_by_batch(eb, budget, estimate, cost):
    """Memoises the plan by effective batch: the same batch under another budget or cost gets the old plan."""
    if eb not in _PLANS:
        _PLANS[eb] = _best(_candidates(eb), budget, estimate, cost)
    return _PLANS[eb]


def back_off_divisors_up_to_16(stack):
    """Searches the new micro-batch among 1..16 only (the graded micro-batches are at most 18)."""
    eff = stack.effective_batch
    if stack.micro_batch > 1:
        mb = max(d for d in range(1, min(stack.micro_batch // 2, 16) + 1) if eff % d == 0)
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    return dataclasses.replace(stack, checkpointing="full") if stack.checkpointing != "full" else None


def back_off_selective_counts_as_full(stack):
    """At micro-batch 1, "selective" checkpointing counts as done (no graded stack uses it): None too early."""
    if stack.micro_batch > 1:
        return train.back_off(stack)
    return None if stack.checkpointing in ("full", "selective") else dataclasses.replace(stack, checkpointing="full")


_BACKED: dict = {}


def back_off_cached_by_batch(stack):
    """Caches the answer by (micro_batch, grad_accum): a stack with other knobs gets the first one's."""
    key = (stack.micro_batch, stack.grad_accum)
    if key not in _BACKED:
        _BACKED[key] = train.back_off(stack)
    return _BACKED[key]


def write_stops_at_an_empty_chunk(path, chunks):
    """Reads chunks with `while chunk := next(it, b"")`: an empty chunk (a zero-length tensor) ends the write early."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    it = iter(chunks)
    try:
        with open(tmp, "wb") as f:
            while chunk := next(it, b""):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_sync_before_rename_only(path, chunks):
    """os.sync() before the rename (the data is durable) and nothing after it: the new name is not."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
        os.sync()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise



MUTANTS = {
    "07.cheapest_stack": [
        ("strict budget (<)", plan_strict_budget),
        ("smallest peak instead of cheapest", plan_smallest_peak),
        ("powers-of-two micro-batches only", plan_powers_of_two),
        ("no checkpointing candidates", plan_no_checkpointing),
        ("first fit", plan_first_fit),
        ("ties to the larger peak", plan_ties_to_larger_peak),
        ("micro-batches that do not divide the batch (floor)", plan_any_micro_batch),
        ("micro-batches that do not divide the batch (ceil)", plan_ceil_accum),
        ("divisors smallest first", plan_smallest_first),
        ("checkpointing first in the order", plan_full_first),
        ("divisors from a table of the graded batches", plan_divisor_table),
        ("costs compared rounded to one decimal", plan_cost_rounded),
        ("plan memoised by effective batch", plan_memoised_by_batch),
    ],
    "07.back_off": [
        ("micro_batch // 2 not a divisor", back_off_naive_halving),
        ("grad_accum not increased", back_off_no_accumulation),
        ("checkpointing first", back_off_checkpointing_first),
        ("other knobs dropped", back_off_drops_knobs),
        ("next smaller divisor (not at most half)", back_off_minus_one),
        ("same stack at the end instead of None", back_off_loops_forever),
        ("divisor of the micro-batch, not of the batch", back_off_divisor_of_micro_batch),
        ("at most ceil(micro_batch / 2)", back_off_ceil_half),
        ("every-k checkpointing counted as done", back_off_any_checkpointing_is_enough),
        ("new micro-batch searched in 1..16 only", back_off_divisors_up_to_16),
        ("selective checkpointing counted as done", back_off_selective_counts_as_full),
        ("answer cached by (micro_batch, grad_accum)", back_off_cached_by_batch),
    ],
    "07.atomic_write": [
        ("writes in place", write_in_place),
        ("no fsync of the data", write_no_fsync),
        ("temp file in /tmp", write_temp_elsewhere),
        ("no directory fsync", write_no_dir_fsync),
        ("rename before fsync", write_rename_then_fsync),
        ("temp file left after an error", write_leaves_temp_on_error),
        ("truncates the target first", write_truncate_then_rename),
        ("moves the good file away (a backup)", write_move_old_away),
        ("fsync before the write", write_fsync_before_writing),
        ("fsync without flush", write_fsync_without_flush),
        ("the current directory fsynced", write_fsyncs_cwd),
        ("directory fsynced before the rename", write_fsyncs_dir_before_rename),
        ("stops at the first empty chunk", write_stops_at_an_empty_chunk),
        ("os.sync before the rename, nothing after", write_sync_before_rename_only),
    ],
    "07.predict_peak": [
        ("AdamW step counters forgotten", predict_no_step_counters),
        ("labels forgotten", predict_forgets_labels),
        ("causal-mask buffers forgotten", predict_forgets_mask_buffers),
        ("accumulated gradients missed", predict_without_accumulated_grads),
        ("one micro-batch of token ids", predict_micro_batch_ids_only),
        ("whole effective batch at once", predict_effective_batch_activations),
        ("SDPA logsumexp forgotten", predict_forgets_logsumexp),
        ("LayerNorm mean/rstd forgotten", predict_forgets_layernorm_stats),
        ("16 bytes per parameter", predict_formula_16_bytes),
        ("a fake-tensor trace", predict_by_fake_trace),
        ("a forward on the meta device", predict_on_meta_device),
    ],
}


# ----------------------------------------------------------------------------- issue 35: 07.predict_peak
# (AdamW's previous denom and the 0-d losses are terms the lecture does not show: the check lets a derivation count
# them or not, so predict_forgets_previous_denom and predict_forgets_loss_scalars above are right answers now.)
def predict_mlp_ratio_4(model_fn, stack, seq_len):
    """The MLP's width written as 4 h (every graded model had mlp_ratio=4), not mlp_ratio x h."""
    return _derive(model_fn, stack, seq_len, ratio=4)


def predict_vocab_256(model_fn, stack, seq_len):
    """The vocabulary written as 256 (byte-level: every graded model had it), not config.vocab_size."""
    return _derive(model_fn, stack, seq_len, vocab=256)


def predict_block_size_as_length(model_fn, stack, seq_len):
    """The activations and token ids of block_size tokens (every graded length but one was the block size)."""
    return _derive(model_fn, stack, seq_len, length=lambda cfg, s: cfg.block_size)


def predict_one_head_logsumexp(model_fn, stack, seq_len):
    """SDPA's logsumexp counted once per token, not once per head (every graded model had 2-4 heads: 4-16 B)."""
    return _derive(model_fn, stack, seq_len, heads=1)


_PARAMS_SEEN: list = []


def predict_params_from_first_model(model_fn, stack, seq_len):
    """Counts the parameters of the first model it is given and keeps the count in a module-level list (the
    model is the costly part): a later model of another size gets the first one's count."""
    if not _PARAMS_SEEN:
        _PARAMS_SEEN.append(sum(p.numel() for p in model_fn().parameters()))
    return _derive(model_fn, stack, seq_len)


MUTANTS["07.predict_peak"] += [
    ("mlp_ratio 4 written in", predict_mlp_ratio_4),
    ("vocabulary 256 written in", predict_vocab_256),
    ("block_size as the sequence length", predict_block_size_as_length),
    ("one logsumexp per token, not per head", predict_one_head_logsumexp),
    ("parameter count kept from the first model", predict_params_from_first_model),
]


# ----------------------------------------------------------------------------- issue 35: 07.atomic_write, the kinds
_DIR_FDS: dict = {}


def write_keeps_directory_fds(path, chunks):
    """Opens each directory once and keeps its descriptor in a module-level dict to fsync it on later writes."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    key = str(path.parent)
    if key not in _DIR_FDS:
        _DIR_FDS[key] = os.open(path.parent, os.O_RDONLY)
    os.fsync(_DIR_FDS[key])


def write_through_a_64k_buffer(path, chunks):
    """Copies each chunk through one preallocated 64 KiB buffer (the largest graded chunk was 50,000 B): a longer
    chunk is cut at 65,536 bytes."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    buf = bytearray(65536)
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                n = min(len(c), len(buf))
                buf[:n] = c[:n]
                f.write(bytes(buf[:n]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


_ESTIMATES: dict = {}


def plan_estimates_memoised(eb, budget, estimate, cost):
    """Right plan, but memoises estimate(stack) in a module-level dict keyed by (estimate, stack), the estimate being
    the costly part: the dict outlives the call and holds every estimator it was given."""
    def cached(s):
        if (estimate, s) not in _ESTIMATES:
            _ESTIMATES[(estimate, s)] = estimate(s)
        return _ESTIMATES[(estimate, s)]
    return _best(_candidates(eb), budget, cached, cost)


_COUNTS: dict = {}


def predict_counts_memoised(model_fn, stack, seq_len):
    """Right formula, but memoises the parameter count per model_fn in a module-level dict (building the model is
    the costly part): state kept between calls."""
    if model_fn not in _COUNTS:
        _COUNTS[model_fn] = sum(p.numel() for p in model_fn().parameters())
    return _derive(model_fn, stack, seq_len)


MUTANTS["07.cheapest_stack"] += [("estimates memoised in a module dict", plan_estimates_memoised)]
MUTANTS["07.predict_peak"] += [("parameter counts memoised in a module dict", predict_counts_memoised)]
MUTANTS["07.atomic_write"] += [
    ("directory descriptors kept in a module dict", write_keeps_directory_fds),
    ("chunks cut at a 64 KiB buffer", write_through_a_64k_buffer),
]

KINDS = {
    "07.cheapest_stack": {"hygiene": ["estimates memoised in a module dict"],
                          "constants": ["divisors from a table of the graded batches"],
                          "space": ["costs compared rounded to one decimal"]},
    "07.back_off": {"hygiene": ["answer cached by (micro_batch, grad_accum)"],
                    "constants": ["new micro-batch searched in 1..16 only"],
                    "space": ["selective checkpointing counted as done"]},
    "07.atomic_write": {"hygiene": ["directory descriptors kept in a module dict"],
                        "constants": ["chunks cut at a 64 KiB buffer"],
                        "space": ["stops at the first empty chunk"]},
    "07.predict_peak": {"hygiene": ["parameter counts memoised in a module dict"],
                        "constants": ["mlp_ratio 4 written in", "vocabulary 256 written in"],
                        "space": ["block_size as the sequence length", "one logsumexp per token, not per head"]},
}


# right answers written another way (the over-specific kind): each must PASS
def write_with_fdatasync(path, chunks):
    """os.fdatasync for the data (enough: the file's size is data-relevant metadata) and for the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fdatasync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_with_imported_replace(path, chunks):
    """``from os import replace`` at the top of the module: the name bound at import time, not looked up on ``os``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def back_off_resets_ckpt_every(stack):
    """The rule, and ckpt_every back to its default when turning "full" on (it only counts under "every-k")."""
    if stack.micro_batch > 1:  # the rule written out (not a call of memlab's back_off: that earns no points)
        eff = stack.micro_batch * stack.grad_accum
        mb = next(d for d in range(stack.micro_batch // 2, 0, -1) if eff % d == 0)
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    if stack.checkpointing != "full":
        return dataclasses.replace(stack, checkpointing="full", ckpt_every=Stack().ckpt_every)
    return None


RIGHT_ANSWERS = {
    "07.atomic_write": [("os.fdatasync", write_with_fdatasync), ("from os import replace", write_with_imported_replace)],
    "07.back_off": [("ckpt_every reset under full", back_off_resets_ckpt_every)],
}
