"""Plausible wrong answers to chapter 08's exercises; tests/course/test_mutants.py asserts each FAILS its check.

MUTANTS maps an exercise id to (name, wrong implementation) pairs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from memlab import distributed as D


# ----------------------------------------------------------------------------- 08.shard_flat
def shard_chunk(flat, rank, world_size):
    """torch.chunk: uneven pieces, and fewer than world_size of them for short buffers."""
    pieces = flat.chunk(world_size)
    return pieces[rank] if rank < len(pieces) else flat[:0]


def shard_interleaved(flat, rank, world_size):
    """Every world_size-th element: equal counts, but not a contiguous piece."""
    s = D.padded_size(flat.numel(), world_size)
    return torch.cat([flat, flat.new_zeros(s - flat.numel())])[rank::world_size]


def shard_floor(flat, rank, world_size):
    """S = numel // world_size: the tail is lost when numel is not a multiple."""
    s = flat.numel() // world_size
    return flat[rank * s:(rank + 1) * s]


def shard_pad_front(flat, rank, world_size):
    """The padding in front: the first shard holds the zeros."""
    s = D.padded_size(flat.numel(), world_size)
    full = torch.cat([flat.new_zeros(s - flat.numel()), flat])
    return full.chunk(world_size)[rank]


def shard_float32(flat, rank, world_size):
    """The right piece, cast to float32."""
    return D.shard_flat(flat, rank, world_size).float()


def shard_pad_with_last(flat, rank, world_size):
    """Pads with copies of the last element instead of zeros: the padding is not neutral in a sum."""
    s = D.padded_size(flat.numel(), world_size)
    full = torch.cat([flat, flat[-1:].expand(s - flat.numel())])
    return full[rank * (s // world_size):(rank + 1) * (s // world_size)]


def shard_reversed_ranks(flat, rank, world_size):
    """Rank r takes piece N-1-r: every rank a right-sized piece, the wrong one."""
    return D.shard_flat(flat, world_size - 1 - rank, world_size)


def shard_one_extra(flat, rank, world_size):
    """S = numel // world_size + 1: one element too many whenever numel divides evenly."""
    s = flat.numel() // world_size + 1
    full = torch.cat([flat, flat.new_zeros(s * world_size - flat.numel())])
    return full[rank * s:(rank + 1) * s]


# ----------------------------------------------------------------------------- 08.reduce_scatter
def _pad(flat, ws):
    return torch.cat([flat, flat.new_zeros(D.padded_size(flat.numel(), ws) - flat.numel())])


def rs_sum(flat_grad, group=None):
    """The sum, not the mean."""
    return D.reduce_scatter_flat(_pad(flat_grad, dist.get_world_size(group)), group, average=False)


def rs_local_only(flat_grad, group=None):
    """No communication: this rank's own gradient, sharded."""
    ws = dist.get_world_size(group)
    return D.shard_flat(flat_grad, dist.get_rank(group), ws).clone()


def rs_wrong_shard(flat_grad, group=None):
    """All-reduce, then the other rank's piece."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    total = _pad(flat_grad, ws)
    dist.all_reduce(total)
    return D.shard_flat(total / ws, (rank + 1) % ws, ws).clone()


def rs_no_padding(flat_grad, group=None):
    """Reduce-scatter without padding: fails on lengths that are not a multiple of the world size."""
    return D.reduce_scatter_flat(flat_grad, group)


def rs_all_reduce_then_shard(flat_grad, group=None):
    """All-reduce the whole gradient, keep this rank's piece: the right numbers, 2 ring passes instead of 1."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    total = _pad(flat_grad, ws)
    dist.all_reduce(total, group=group)
    return D.shard_flat(total, rank, ws).clone() / ws


def rs_all_gather_then_sum(flat_grad, group=None):
    """The all-reduce shortcut under another name: all-gather every rank's gradient, sum locally."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = _pad(flat_grad, ws)
    parts = [torch.empty_like(padded) for _ in range(ws)]
    dist.all_gather(parts, padded, group=group)
    total = parts[0].clone()
    for t in parts[1:]:
        total += t
    return D.shard_flat(total, rank, ws).clone() / ws


def rs_all_to_all_then_sum(flat_grad, group=None):
    """all_to_all_single, then a local sum: a collective CommCounter does not count (it must refuse it)."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = _pad(flat_grad, ws)
    recv = torch.empty_like(padded)
    dist.all_to_all_single(recv, padded, group=group)
    return recv.reshape(ws, -1).sum(0) / ws


def rs_averages_twice(flat_grad, group=None):
    """Divides by the world size before the reduce-scatter and again after."""
    ws = dist.get_world_size(group)
    return D.reduce_scatter_flat(_pad(flat_grad / ws, ws), group) / ws


# ----------------------------------------------------------------------------- 08.zero1_step
def _shard_of_sum(flat_grad):
    out = flat_grad.new_empty(flat_grad.numel() // dist.get_world_size())
    dist.reduce_scatter_tensor(out, flat_grad)
    return out


def zero1_no_all_gather(flat_param, flat_grad, optimizer):
    """Steps on the shard but never all-gathers: the other shard stays stale on this rank."""
    optimizer.param_groups[0]["params"][0].grad = _shard_of_sum(flat_grad) / dist.get_world_size()
    optimizer.step()


def zero1_sum(flat_param, flat_grad, optimizer):
    """The summed gradient (no division by the world size)."""
    a, b = D.shard_range(flat_param.numel(), dist.get_rank(), dist.get_world_size())
    optimizer.param_groups[0]["params"][0].grad = _shard_of_sum(flat_grad)
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


def zero1_local_grad(flat_param, flat_grad, optimizer):
    """Forgets to average the gradients over the ranks: each shard steps on its own rank's gradient."""
    a, b = D.shard_range(flat_param.numel(), dist.get_rank(), dist.get_world_size())
    optimizer.param_groups[0]["params"][0].grad = flat_grad[a:b].clone()
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


def zero1_gather_before_step(flat_param, flat_grad, optimizer):
    """All-gathers before the step: every rank sees the other shard one step late."""
    a, b = D.shard_range(flat_param.numel(), dist.get_rank(), dist.get_world_size())
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)
    optimizer.param_groups[0]["params"][0].grad = _shard_of_sum(flat_grad) / dist.get_world_size()
    optimizer.step()


def zero1_all_reduce(flat_param, flat_grad, optimizer):
    """All-reduces the whole gradient and uses only its shard: the right numbers, 3 ring passes instead of 2."""
    dist.all_reduce(flat_grad)
    flat_grad.div_(dist.get_world_size())
    a, b = D.shard_range(flat_param.numel(), dist.get_rank(), dist.get_world_size())
    optimizer.param_groups[0]["params"][0].grad = flat_grad[a:b]
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


def zero1_averages_twice(flat_param, flat_grad, optimizer):
    """Pre-divides the gradient by N (as DDP's hooks do) and divides the reduce-scattered sum by N again:
    AdamW hides the factor 1/N, SGD does not."""
    ws = dist.get_world_size()
    a, b = D.shard_range(flat_param.numel(), dist.get_rank(), ws)
    optimizer.param_groups[0]["params"][0].grad = _shard_of_sum(flat_grad / ws) / ws
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


def zero1_all_gather_grads(flat_param, flat_grad, optimizer):
    """The all-reduce shortcut under another name: all-gather every rank's whole gradient and sum it."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(flat_grad) for _ in range(ws)]
    dist.all_gather(parts, flat_grad)
    a, b = D.shard_range(flat_param.numel(), rank, ws)
    total = parts[0][a:b].clone()
    for t in parts[1:]:
        total += t[a:b]
    optimizer.param_groups[0]["params"][0].grad = total / ws
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


def zero1_reduce_whole_buffer(flat_param, flat_grad, optimizer):
    """One dist.reduce of the whole gradient to each rank in turn: an all-reduce's bytes, N times over."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    a, b = D.shard_range(flat_param.numel(), rank, ws)
    mine = None
    for owner in range(ws):
        buf = flat_grad.clone()
        dist.reduce(buf, dst=owner)
        if owner == rank:
            mine = buf[a:b].clone()
    optimizer.param_groups[0]["params"][0].grad = mine / ws
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


def zero1_all_to_all(flat_param, flat_grad, optimizer):
    """all_to_all_single then a local sum (right bytes, but a collective CommCounter must refuse, not count as free)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    a, b = D.shard_range(flat_param.numel(), rank, ws)
    recv = torch.empty_like(flat_grad)
    dist.all_to_all_single(recv, flat_grad)
    optimizer.param_groups[0]["params"][0].grad = recv.reshape(ws, -1).sum(0) / ws
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


# ----------------------------------------------------------------------------- 08.predict_rank_bytes
def _counts(model, world_size):
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    return params, n, D.padded_size(n, world_size) // world_size


def _right(model, world_size, stage):
    params, n, shard = _counts(model, world_size)
    if stage == 0:
        return {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * len(params)}
    if stage in (1, 2):
        return {"parameters": 4 * shard * world_size, "gradients": 4 * shard * (world_size if stage == 1 else 1),
                "optimizer": 8 * shard + 4}
    local = sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) for p in params)
    return {"parameters": 4 * local, "gradients": 4 * local, "optimizer": 8 * local + 4 * len(params)}


def predict_stage2_grads_full(model, world_size, stage):
    """ZeRO-2 keeps the whole gradient (the gradients are not sharded)."""
    out = _right(model, world_size, stage)
    if stage == 2:
        out["gradients"] = _right(model, world_size, 1)["gradients"]
    return out


def predict_one_moment(model, world_size, stage):
    """AdamW keeps one 4-byte moment per parameter (it keeps two)."""
    out = _right(model, world_size, stage)
    out["optimizer"] -= out["optimizer"] // 2 - (2 if stage in (1, 2) else 2 * len(list(model.parameters())))
    return out


def predict_params_sharded_from_stage1(model, world_size, stage):
    """Shards the parameters from stage 1 on (that is stage 3's saving, not stage 1's)."""
    out = _right(model, world_size, stage)
    if stage in (1, 2):
        out["parameters"] //= world_size
    return out


def predict_grads_after_zero_grad(model, world_size, stage):
    """Counts a full gradient at every stage: zero_grad(set_to_none) frees stage 0's and FSDP2's."""
    params, n, shard = _counts(model, world_size)
    return {"parameters": 4 * (n if stage < 3 else shard), "gradients": 4 * n,
            "optimizer": 8 * (n if stage == 0 else shard)}


def predict_after_zero_grad(model, world_size, stage):
    """What a rank holds after zero_grad(set_to_none=True): no gradients at stages 0 and 3. Not the state
    at the peak, and not the paper's formula (data parallelism holds 4 B/param of gradients in the step)."""
    out = _right(model, world_size, stage)
    if stage in (0, 3):
        out["gradients"] = 0
    return out


def predict_tied_counted_twice(model, world_size, stage):
    """Counts parameters over named_parameters(remove_duplicate=False): tied embeddings twice."""
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    n = sum(p.numel() for p in params)
    shard = D.padded_size(n, world_size) // world_size
    out = _right(model, world_size, stage)
    if stage == 0:
        return {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * len(params)}
    if stage in (1, 2):
        return {"parameters": 4 * shard * world_size, "gradients": 4 * shard * (world_size if stage == 1 else 1),
                "optimizer": 8 * shard + 4}
    return out


def predict_no_step_counters(model, world_size, stage):
    """AdamW's two moments, but not its 4-byte step counter per parameter tensor it steps."""
    out = _right(model, world_size, stage)
    params = list(model.parameters())
    out["optimizer"] -= 4 * (len(params) if stage in (0, 3) else 1)
    return out


def predict_fsdp_even_split(model, world_size, stage):
    """FSDP2 as n / N per rank: forgets that each parameter is padded on its first dimension."""
    out = _right(model, world_size, stage)
    if stage == 3:
        params, n, _ = _counts(model, world_size)
        out = {"parameters": 4 * n // world_size, "gradients": 4 * n // world_size,
               "optimizer": 8 * n // world_size + 4 * len(params)}
    return out


MUTANTS = {
    "08.shard_flat": [
        ("torch.chunk: uneven shards", shard_chunk),
        ("interleaved, not contiguous", shard_interleaved),
        ("floor division: tail lost", shard_floor),
        ("padding in front", shard_pad_front),
        ("cast to float32", shard_float32),
        ("padded with the last element", shard_pad_with_last),
        ("ranks in reverse order", shard_reversed_ranks),
        ("one element too many per shard", shard_one_extra),
    ],
    "08.reduce_scatter": [
        ("sum, not mean", rs_sum),
        ("no communication", rs_local_only),
        ("the other rank's shard", rs_wrong_shard),
        ("no padding", rs_no_padding),
        ("all-reduce, then this rank's piece (2 passes)", rs_all_reduce_then_shard),
        ("all-gather every gradient, then sum", rs_all_gather_then_sum),
        ("all-to-all, then sum (uncounted collective)", rs_all_to_all_then_sum),
        ("averaged twice", rs_averages_twice),
    ],
    "08.zero1_step": [
        ("no all-gather after the step", zero1_no_all_gather),
        ("summed gradient", zero1_sum),
        ("local gradient only", zero1_local_grad),
        ("all-gather before the step", zero1_gather_before_step),
        ("all-reduce instead of reduce-scatter", zero1_all_reduce),
        ("averaged twice (AdamW hides it)", zero1_averages_twice),
        ("all-reduce shortcut as an all-gather", zero1_all_gather_grads),
        ("all-reduce shortcut as N whole-buffer reduces", zero1_reduce_whole_buffer),
        ("all-to-all (uncounted collective)", zero1_all_to_all),
    ],
    "08.predict_rank_bytes": [
        ("ZeRO-2 gradients not sharded", predict_stage2_grads_full),
        ("one AdamW moment", predict_one_moment),
        ("parameters sharded from stage 1", predict_params_sharded_from_stage1),
        ("gradients held after zero_grad", predict_grads_after_zero_grad),
        ("after zero_grad, not at the step", predict_after_zero_grad),
        ("tied embeddings counted twice", predict_tied_counted_twice),
        ("AdamW step counters forgotten", predict_no_step_counters),
        ("FSDP2 as an even n / N split", predict_fsdp_even_split),
    ],
}


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
def shard_pads_in_place(flat, rank, world_size):
    """Pads the caller's buffer in place (resize_) so that it divides evenly."""
    pad = D.padded_size(flat.numel(), world_size)
    n = flat.numel()
    if pad != n:
        flat.resize_(pad)
        flat[n:] = 0
    return flat.chunk(world_size)[rank].clone()


_PADDED: dict = {}


def shard_cached_padding(flat, rank, world_size):
    """Keeps the padded copy by (numel, world size) to pad once: a new buffer of the same size gets the old values."""
    key = (flat.numel(), world_size)
    if key not in _PADDED:
        _PADDED[key] = torch.cat([flat, flat.new_zeros(D.padded_size(flat.numel(), world_size) - flat.numel())])
    return _PADDED[key].chunk(world_size)[rank].clone()


def shard_float_padding(flat, rank, world_size):
    """Pads with torch.zeros (float32): an int64 or float64 buffer comes back float32 or promoted."""
    pad = torch.zeros(D.padded_size(flat.numel(), world_size) - flat.numel())
    return torch.cat([flat.float(), pad]).to(flat.dtype if flat.is_floating_point() and flat.dtype != torch.float64
                                             else torch.float32).chunk(world_size)[rank].clone()


MUTANTS["08.shard_flat"] += [
    ("pads the caller's buffer in place", shard_pads_in_place),
    ("padded copy cached by size", shard_cached_padding),
    ("float32 padding", shard_float_padding),
]


# ----------------------------------------------------------------------------- issue 35: 08.reduce_scatter, 08.zero1_step
def rs_divides_by_two(flat_grad, group=None):
    """The mean as a sum halved: the world size 2 written in (every graded run had 2 ranks)."""
    ws = dist.get_world_size(group)
    out = flat_grad.new_empty(D.padded_size(flat_grad.numel(), ws) // ws)
    dist.reduce_scatter_tensor(out, _pad(flat_grad, ws), group=group)
    return out * 0.5


def rs_ignores_group(flat_grad, group=None):
    """Sizes the shard by the group but reduces over the default group (group= not passed on)."""
    ws = dist.get_world_size(group)
    out = flat_grad.new_empty(D.padded_size(flat_grad.numel(), ws) // ws)
    if group is not None and ws != dist.get_world_size():
        return D.reduce_scatter_flat(_pad(flat_grad, dist.get_world_size()))[:out.numel()]
    dist.reduce_scatter_tensor(out, _pad(flat_grad, ws))
    return out / ws


def rs_float32_padding(flat_grad, group=None):
    """Pads with torch.zeros(pad), float32 whatever the gradient's dtype: a bf16 gradient comes back float32."""
    ws = dist.get_world_size(group)
    padded = torch.cat([flat_grad, torch.zeros(D.padded_size(flat_grad.numel(), ws) - flat_grad.numel())])
    out = padded.new_empty(padded.numel() // ws)
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out / ws


def rs_divides_caller_grad(flat_grad, group=None):
    """Divides the caller's gradient by N in place first (to average before summing): the caller's buffer changes."""
    ws = dist.get_world_size(group)
    flat_grad.div_(ws)
    out = flat_grad.new_empty(D.padded_size(flat_grad.numel(), ws) // ws)
    dist.reduce_scatter_tensor(out, _pad(flat_grad, ws), group=group)
    return out


_RS_OUT: dict = {}


def rs_output_kept_by_size(flat_grad, group=None):
    """Keeps the output buffer by size between calls (allocated once): each call returns the same tensor."""
    ws = dist.get_world_size(group)
    key = (D.padded_size(flat_grad.numel(), ws) // ws, flat_grad.dtype)
    if key not in _RS_OUT:
        _RS_OUT[key] = flat_grad.new_empty(key[0])
    out = _RS_OUT[key]
    dist.reduce_scatter_tensor(out, _pad(flat_grad, ws), group=group)
    return out.div_(ws)


def zero1_divides_by_two(flat_param, flat_grad, optimizer):
    """The mean as the summed shard halved: the world size 2 written in."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    a, b = D.shard_range(flat_param.numel(), rank, ws)
    optimizer.param_groups[0]["params"][0].grad = _shard_of_sum(flat_grad) / 2
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


def zero1_float32_scratch(flat_param, flat_grad, optimizer):
    """The reduce-scatter's output made with torch.empty (float32): fp64 and bf16 buffers do not fit it."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    a, b = D.shard_range(flat_param.numel(), rank, ws)
    summed = torch.empty(b - a)
    dist.reduce_scatter_tensor(summed, flat_grad.float())
    optimizer.param_groups[0]["params"][0].grad = (summed / ws).to(flat_param.dtype)
    optimizer.step()
    D.all_gather_flat(flat_param[a:b].clone(), out=flat_param)


_SHARD_RANGE: list = []


def zero1_range_from_first_call(flat_param, flat_grad, optimizer):
    """Works out this rank's slice on the first call and keeps it in a module-level list: a later buffer of
    another length is cut with the first one's slice."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    if not _SHARD_RANGE:
        _SHARD_RANGE.append(D.shard_range(flat_param.numel(), rank, ws))
    a, b = _SHARD_RANGE[0]
    if b - a != flat_param.numel() // ws:  # the wrong size cannot be reduce-scattered: keep going as if it could
        a, b = rank * (flat_param.numel() // ws), (rank + 1) * (flat_param.numel() // ws)
        b = a + min(b - a, _SHARD_RANGE[0][1] - _SHARD_RANGE[0][0])
    summed = flat_grad.new_empty(flat_param.numel() // ws)
    dist.reduce_scatter_tensor(summed, flat_grad)
    optimizer.param_groups[0]["params"][0].grad = summed / ws
    optimizer.step()
    D.all_gather_flat(flat_param[a:a + summed.numel()].clone(), out=flat_param)


def zero1_even_split(flat_param, flat_grad, optimizer):
    """Steps the shard, then gathers with all_gather into a list sized from flat_param.numel() // 2 per rank."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    half = flat_param.numel() // 2
    a, b = D.shard_range(flat_param.numel(), rank, ws)
    optimizer.param_groups[0]["params"][0].grad = _shard_of_sum(flat_grad) / ws
    optimizer.step()
    parts = [flat_param.new_empty(b - a) for _ in range(ws)]
    dist.all_gather(parts, flat_param[a:b].clone())
    flat_param[:2 * half].copy_(torch.cat(parts)[:2 * half])


MUTANTS["08.reduce_scatter"] += [
    ("mean as the sum halved (world size 2 written in)", rs_divides_by_two),
    ("group= not passed to the collective", rs_ignores_group),
    ("float32 padding", rs_float32_padding),
    ("divides the caller's gradient in place", rs_divides_caller_grad),
    ("output buffer kept by size between calls", rs_output_kept_by_size),
]
MUTANTS["08.zero1_step"] += [
    ("mean as the sum halved (world size 2 written in)", zero1_divides_by_two),
    ("float32 scratch for the reduce-scatter", zero1_float32_scratch),
    ("this rank's slice kept from the first call", zero1_range_from_first_call),
]


# ----------------------------------------------------------------------------- issue 35: the kinds, labelled
def shard_pads_to_eight(flat, rank, world_size):
    """Pads to a multiple of 8 (every graded world size divided 8), then cuts world_size equal pieces of that."""
    n = flat.numel()
    s = -(-n // 8) * 8
    per = -(-s // world_size)
    full = torch.cat([flat, flat.new_zeros(per * world_size - n)])
    return full[rank * per:(rank + 1) * per].clone()


MUTANTS["08.shard_flat"] += [("padded to a multiple of 8", shard_pads_to_eight)]

def predict_two_ranks_written_in(model, world_size, stage):
    """The shard as padded(n, 2) / 2: the world size 2 written in (every graded prediction was for 2 ranks)."""
    return _right(model, 2, stage) if stage in (1, 2) else _right(model, world_size, stage)


_PARAMS_OF: dict = {}


def predict_params_memoised(model, world_size, stage):
    """Right numbers, but the parameter list memoised per model in a module-level dict (listing them is "costly"):
    the dict keeps every model it was given alive."""
    if id(model) not in _PARAMS_OF:
        _PARAMS_OF[id(model)] = (model, list(model.parameters()))
    return _right(model, world_size, stage)


MUTANTS["08.predict_rank_bytes"] += [("world size 2 written in", predict_two_ranks_written_in),
                                     ("parameters memoised per model in a module dict", predict_params_memoised)]

KINDS = {
    "08.shard_flat": {"hygiene": ["pads the caller's buffer in place", "padded copy cached by size"],
                      "constants": ["padded to a multiple of 8"],
                      "space": ["float32 padding", "torch.chunk: uneven shards", "floor division: tail lost"]},
    "08.reduce_scatter": {"hygiene": ["divides the caller's gradient in place", "output buffer kept by size between calls"],
                          "constants": ["mean as the sum halved (world size 2 written in)"],
                          "space": ["float32 padding"]},
    "08.zero1_step": {"hygiene": ["this rank's slice kept from the first call"],
                      "constants": ["mean as the sum halved (world size 2 written in)"],
                      "space": ["float32 scratch for the reduce-scatter"]},
    "08.predict_rank_bytes": {"hygiene": ["parameters memoised per model in a module dict"],
                              "constants": ["world size 2 written in"],
                              "space": ["FSDP2 as an even n / N split", "tied embeddings counted twice"]},
}
