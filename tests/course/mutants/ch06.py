"""Plausible wrong answers to chapter 06's exercises; tests/course/test_mutants.py asserts each FAILS its check.

MUTANTS maps an exercise id to (name, wrong implementation) pairs.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from memlab import quant
from memlab.quant import lora
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # mutant_helpers, beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_helpers import counted_on_the_class as _counted_on_the_class  # noqa: E402
from mutant_helpers import memoised as _memoised  # noqa: E402


# ----------------------------------------------------------------------------- 06.nf4_codebook
def codebook_symmetric(offset=0.9677083):
    """7 levels per side (the symmetric variant): no extra positive level, so only 15 values (+ a pad 0)."""
    p = torch.linspace(offset, 0.5, 8)[:-1].double()
    v = torch.cat([torch.special.ndtri(p), torch.zeros(2, dtype=torch.float64), -torch.special.ndtri(p)])
    v = v.float().sort().values
    return v / v.max()


def codebook_pasted(offset=0.9677083):
    """The right numbers at the default offset, pasted: ignores offset."""
    return quant.nf4_codebook()


def codebook_float64(offset=0.9677083):
    """Normalised in float64 and kept there: the right maths, the wrong dtype and last bits."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return v / v.max()


def codebook_not_normalised(offset=0.9677083):
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    return torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).float().sort().values


def codebook_even_quantiles(offset=0.9677083):
    """Quantiles of 16 equal-probability bins over (1-offset, offset): no exact zero."""
    p = torch.linspace(1 - offset, offset, 16).double()
    v = torch.special.ndtri(p).float()
    return v / v.max()


def codebook_float64_probabilities(offset=0.9677083):
    """torch.linspace in float64: bitsandbytes takes float32 probabilities (the default dtype)."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).float().sort().values
    return v / v.max()


def codebook_ndtri_float32(offset=0.9677083):
    """ndtri in float32 (bitsandbytes computes the quantiles in float64)."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1])
    v = torch.cat([pos, torch.zeros(1), neg]).sort().values
    return v / v.max()


def codebook_normalised_in_float64(offset=0.9677083):
    """Divides by the largest level in float64, then casts: one rounding fewer than bitsandbytes."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (v / v.max()).float()


def codebook_halves_swapped(offset=0.9677083):
    """8 negative levels and 7 positive ones: -1 and 1 trade places."""
    return -codebook_not_normalised(offset).flip(0) / codebook_not_normalised(offset).abs().max()


# ----------------------------------------------------------------------------- 06.nf4_codes
def _scaled(w, blocksize):
    flat = w.reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // blocksize)
    pad = torch.cat([flat, flat.new_zeros(blocks * blocksize - n)]).reshape(blocks, blocksize)
    absmax = pad.abs().amax(1)
    return torch.clamp(pad / absmax.clamp(min=1e-38).unsqueeze(1), -1, 1).reshape(-1)[:n], absmax


def codes_ties_upward(w, blocksize=64):
    """bucketize(right=True): a value exactly on a midpoint goes to the upper level."""
    s, a = _scaled(w, blocksize)
    c = quant.nf4_codebook()
    return torch.bucketize(s, (c[:-1] + c[1:]) / 2, right=True).to(torch.uint8), a


def codes_global_absmax(w, blocksize=64):
    """One scale for the whole tensor instead of one per block."""
    flat = w.reshape(-1).float()
    am = flat.abs().max()
    c = quant.nf4_codebook()
    q = torch.bucketize(flat / am, (c[:-1] + c[1:]) / 2).to(torch.uint8)
    return q, am.repeat(-(-flat.numel() // blocksize))


def codes_max_not_absmax(w, blocksize=64):
    """Scales by the block's max, not its absolute max: negative outliers clip."""
    flat = w.reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // blocksize)
    pad = torch.cat([flat, flat.new_full((blocks * blocksize - n,), -float("inf"))]).reshape(blocks, blocksize)
    m = pad.amax(1)
    s = torch.clamp(flat / m.repeat_interleave(blocksize)[:n], -1, 1)
    c = quant.nf4_codebook()
    return torch.bucketize(s, (c[:-1] + c[1:]) / 2).to(torch.uint8), m


def codes_int64(w, blocksize=64):
    """Right codes, returned as int64 (8x the bytes of uint8)."""
    q, a = quant.nf4_codes(w, blocksize)
    return q.long(), a


def codes_nearest_by_rounding(w, blocksize=64):
    """Treats the levels as evenly spaced: round(s * 7.5 + 7.5), int4-style."""
    s, a = _scaled(w, blocksize)
    return torch.round(s * 7.5 + 7.5).clamp(0, 15).to(torch.uint8), a


def codes_argmin_distance(w, blocksize=64):
    """argmin |s - level|: nearest level by distance, computed in float32 (ties land where rounding says)."""
    flat = w.reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().amax(1)
    s = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1), -1, 1).reshape(-1)
    if n > full:
        t = flat[full:].abs().max().clamp(min=1e-38)
        absmax, s = torch.cat([absmax, t.reshape(1)]), torch.cat([s, torch.clamp(flat[full:] / t, -1, 1)])
    c = quant.nf4_codebook()
    return (s.unsqueeze(1) - c).abs().argmin(1).to(torch.uint8), absmax


def codes_clamped_absmax_stored(w, blocksize=64):
    """Stores the clamped absmax: an all-zero full block keeps 1e-38 (bitsandbytes stores its 0.0)."""
    q, a = quant.nf4_codes(w, blocksize)
    return q, a.clamp(min=1e-38)


def codes_blocks_per_row(w, blocksize=64):
    """Cuts every row into its own blocks (bitsandbytes cuts the flattened tensor)."""
    rows = w.reshape(-1, w.shape[-1]) if w.dim() > 1 else w.reshape(1, -1)
    qs, am = [], []
    for row in rows:
        q, a = quant.nf4_codes(row, blocksize)
        qs.append(q)
        am.append(a)
    return torch.cat(qs), torch.cat(am)


def codes_absmax_in_input_dtype(w, blocksize=64):
    """Keeps absmax in the input's dtype (bf16 / fp16 inputs give 16-bit scales)."""
    q, a = quant.nf4_codes(w, blocksize)
    return q, a.to(w.dtype)


# ----------------------------------------------------------------------------- 06.pack_nibbles
def pack_low_first(q):
    q = q.reshape(-1).to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_full((1,), 7)])
    return q[0::2] | (q[1::2] << 4)


def pack_pads_with_zero(q):
    """Pads an odd count with code 0 (the -1.0 level), not 7 (0.0)."""
    q = q.reshape(-1).to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return (q[0::2] << 4) | q[1::2]


def pack_drops_last(q):
    q = q.reshape(-1).to(torch.uint8)
    n = q.numel() - q.numel() % 2
    return (q[0:n:2] << 4) | q[1:n:2]


def pack_int64(q):
    q = q.reshape(-1).long()
    if q.numel() % 2:
        q = torch.cat([q, q.new_full((1,), 7)])
    return q[0::2] * 16 + q[1::2]


def pack_pads_with_8(q):
    """Pads with code 8, the smallest positive level (not 7, the zero)."""
    return quant.pack_nibbles(q, pad=8)


def pack_column(q):
    """The right bytes in bitsandbytes' stored shape (n/2, 1) instead of a flat tensor."""
    return quant.pack_nibbles(q).reshape(-1, 1)


def pack_int32(q):
    """The right values in int32 (4 bytes per packed byte)."""
    return quant.pack_nibbles(q).to(torch.int32)


# ----------------------------------------------------------------------------- 06.dequantize_nf4
def _unpack(packed, n, high_first=True):
    p = packed.reshape(-1)
    hi, lo = (p >> 4).long(), (p & 0xF).long()
    q = torch.stack([hi, lo] if high_first else [lo, hi], 1).reshape(-1)
    return q[:n]


def deq_in_target_dtype(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    """Multiplies in the 16-bit dtype: one more rounding than float32-then-cast."""
    n = math.prod(shape)
    v = quant.nf4_codebook().to(dtype)[_unpack(packed, n)]
    return (v * absmax.to(dtype).repeat_interleave(blocksize)[:n]).reshape(shape)


def deq_repeat_not_interleave(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    """absmax.repeat(blocksize): scales cycle through the blocks instead of one per block."""
    n = math.prod(shape)
    v = quant.nf4_codebook()[_unpack(packed, n)]
    return (v * absmax.repeat(blocksize)[:n]).reshape(shape).to(dtype)


def deq_low_nibble_first(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    n = math.prod(shape)
    v = quant.nf4_codebook()[_unpack(packed, n, high_first=False)]
    return (v * absmax.repeat_interleave(blocksize)[:n]).reshape(shape).to(dtype)


def deq_divides(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    """Divides by absmax (undoing the wrong way round)."""
    n = math.prod(shape)
    v = quant.nf4_codebook()[_unpack(packed, n)]
    return (v / absmax.repeat_interleave(blocksize)[:n]).reshape(shape).to(dtype)


def deq_codebook_in_dtype(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    """Rounds the codebook to the target dtype first, then multiplies in float32."""
    n = math.prod(shape)
    v = quant.nf4_codebook().to(dtype).float()[_unpack(packed, n)]
    return (v * absmax.repeat_interleave(blocksize)[:n]).reshape(shape).to(dtype)


def deq_last_codes(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    """Keeps the last n codes (the pad nibble is at the end, not the start)."""
    n = math.prod(shape)
    p = packed.reshape(-1)
    q = torch.stack([(p >> 4).long(), (p & 0xF).long()], 1).reshape(-1)[-n:]
    return (quant.nf4_codebook()[q] * absmax.repeat_interleave(blocksize)[:n]).reshape(shape).to(dtype)


def deq_always_float32(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    """Forgets the cast to dtype."""
    return quant.dequantize_nf4(packed, absmax, shape, torch.float32, blocksize)


def deq_fixed_blocksize(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    """Ignores blocksize: always 64."""
    return quant.dequantize_nf4(packed, absmax, shape, dtype, 64)


# ----------------------------------------------------------------------------- 06.lora_linear
class _LoRABase(nn.Module):
    def __init__(self, base, r=8, alpha=16, dropout=0.0):
        super().__init__()
        self.base, self.r, self.alpha, self.scaling = base, r, alpha, alpha / r
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.merged = False

    def delta(self):
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x):
        y = self.base(x)
        return y if self.merged else y + self.lora_B(self.lora_A(x)) * self.scaling

    @torch.no_grad()
    def merge(self):
        self.base.weight += self.delta()
        self.merged = True

    @torch.no_grad()
    def unmerge(self):
        self.base.weight -= self.delta()
        self.merged = False


class LoRAScalingAlpha(_LoRABase):
    """Scales by alpha, not alpha / r."""

    def __init__(self, base, r=8, alpha=16, dropout=0.0):
        super().__init__(base, r, alpha, dropout)
        self.scaling = float(alpha)


class LoRANoReinit(nn.Module):
    """Keeps nn.Linear's own init for A (same distribution, but peft re-draws it: other numbers under a seed)."""

    def __init__(self, base, r=8, alpha=16, dropout=0.0):
        super().__init__()
        self.base, self.scaling = base, alpha / r
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.merged = False

    forward, merge, unmerge, delta = _LoRABase.forward, _LoRABase.merge, _LoRABase.unmerge, _LoRABase.delta


class LoRAMergeForgetsScaling(_LoRABase):
    def delta(self):
        return self.lora_B.weight @ self.lora_A.weight


class LoRAMergedStillAdds(_LoRABase):
    """merge() folds the adapter in, but forward still adds it: counted twice."""

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


class LoRABaseTrainable(_LoRABase):
    """Forgets to freeze the base layer."""

    def __init__(self, base, r=8, alpha=16, dropout=0.0):
        super().__init__(base, r, alpha, dropout)
        for p in base.parameters():
            p.requires_grad_(True)


class LoRAIntegerScaling(_LoRABase):
    """alpha // r: right whenever r divides alpha."""

    def __init__(self, base, r=8, alpha=16, dropout=0.0):
        super().__init__(base, r, alpha, dropout)
        self.scaling = alpha // r


class LoRABaseUnderNoGrad(_LoRABase):
    """Runs the frozen base under torch.no_grad ("it has nothing to train"): dL/dx loses the base's path."""

    def forward(self, x):
        with torch.no_grad():
            y = self.base(x)
        return y if self.merged else y + self.lora_B(self.lora_A(x)) * self.scaling


class LoRADetachedInput(_LoRABase):
    """Feeds the adapter x.detach(): its weights still get gradients, dL/dx loses the adapter's path."""

    def forward(self, x):
        y = self.base(x)
        return y if self.merged else y + self.lora_B(self.lora_A(x.detach())) * self.scaling


# ----------------------------------------------------------------------------- 06.predict_qlora_bytes
def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] != "lm_head"]


def _others(model):
    q = {id(m.weight) for _, m in _linears(model)} | {id(m.bias) for _, m in _linears(model) if m.bias is not None}
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in q or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def predict_fp32_scales(model, r=8):
    """No double quantization: 4 bytes of absmax per 64 weights instead of 1."""
    total = _others(model)
    for _, m in _linears(model):
        n = m.in_features * m.out_features
        total += n // 2 + 4 * (n // 64) + 4 * r * (m.in_features + m.out_features) + (2 * m.out_features if m.bias is not None else 0)
    return total


def predict_no_lora(model, r=8):
    return lora.predict_qlora_bytes(model, r) - sum(4 * r * (m.in_features + m.out_features) for _, m in _linears(model))


def predict_quantizes_lm_head(model, r=8):
    """Treats lm_head as one more 4-bit linear."""
    total = lora.predict_qlora_bytes(model, r)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        n = head.in_features * head.out_features
        total += -4 * n + n // 2 + n // 64 + 4 * r * (head.in_features + head.out_features)
    return total


def predict_half_a_byte_is_a_byte(model, r=8):
    """One byte per 4-bit code."""
    return lora.predict_qlora_bytes(model, r) + sum(m.in_features * m.out_features // 2 for _, m in _linears(model))


def predict_counts_tied_twice(model, r=8):
    """Counts every parameter's bytes, so tied embeddings twice."""
    total = lora.predict_qlora_bytes(model, r)
    seen = set()
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key in seen:
            total += p.untyped_storage().nbytes()
        seen.add(key)
    return total if total != lora.predict_qlora_bytes(model, r) else total + 4 * sum(
        m.out_features for _, m in _linears(model))  # and the biases in fp32


def _quantized_terms(model):
    return [(m.in_features, m.out_features, m.bias is not None) for _, m in _linears(model)]


def predict_no_second_level(model, r=8):
    """Forgets the fp32 second-level scales (one per 256 first-level scales) and the fp32 offset."""
    total = lora.predict_qlora_bytes(model, r)
    for fin, fout, _ in _quantized_terms(model):
        blocks = -(-fin * fout // 64)
        total -= 4 * -(-blocks // 256) + 4
    return total


def predict_no_offset(model, r=8):
    """Forgets the one fp32 offset per layer that double quantization subtracts from the scales."""
    return lora.predict_qlora_bytes(model, r) - 4 * len(_quantized_terms(model))


def predict_padding_once(model, r=8):
    """Rounds up once for the whole model (blocks and half-bytes), not once per tensor."""
    total = lora.predict_qlora_bytes(model, r)
    n_all = 0
    for fin, fout, _ in _quantized_terms(model):
        n = fin * fout
        blocks = -(-n // 64)
        total -= -(-n // 2) + blocks + 4 * -(-blocks // 256)
        n_all += n
    blocks = -(-n_all // 64)
    return total + -(-n_all // 2) + blocks + 4 * -(-blocks // 256)


def predict_floor_half(model, r=8):
    """n // 2 code bytes: an odd count loses its last (padded) byte."""
    return lora.predict_qlora_bytes(model, r) - sum((fin * fout) % 2 for fin, fout, _ in _quantized_terms(model))


MUTANTS = {
    "06.nf4_codebook": [
        ("symmetric 7+7 levels", codebook_symmetric),
        ("pasted: ignores offset", codebook_pasted),
        ("float64", codebook_float64),
        ("not normalised to [-1, 1]", codebook_not_normalised),
        ("16 even quantiles, no zero", codebook_even_quantiles),
        ("float64 probabilities", codebook_float64_probabilities),
        ("ndtri in float32", codebook_ndtri_float32),
        ("normalised in float64, then cast", codebook_normalised_in_float64),
        ("8 negative, 7 positive levels", codebook_halves_swapped),
    ],
    "06.nf4_codes": [
        ("ties go to the upper level", codes_ties_upward),
        ("one absmax for the whole tensor", codes_global_absmax),
        ("max instead of abs max", codes_max_not_absmax),
        ("int64 codes", codes_int64),
        ("evenly spaced rounding (int4 thinking)", codes_nearest_by_rounding),
        ("argmin of the distance", codes_argmin_distance),
        ("all-zero block stores the clamped absmax", codes_clamped_absmax_stored),
        ("blocks per row", codes_blocks_per_row),
        ("absmax in the input dtype", codes_absmax_in_input_dtype),
    ],
    "06.pack_nibbles": [
        ("low nibble first", pack_low_first),
        ("odd count padded with code 0", pack_pads_with_zero),
        ("odd count: last code dropped", pack_drops_last),
        ("int64 bytes", pack_int64),
        ("odd count padded with code 8", pack_pads_with_8),
        ("shape (n/2, 1)", pack_column),
        ("int32 bytes", pack_int32),
    ],
    "06.dequantize_nf4": [
        ("multiplies in the 16-bit dtype", deq_in_target_dtype),
        ("absmax.repeat instead of repeat_interleave", deq_repeat_not_interleave),
        ("low nibble first", deq_low_nibble_first),
        ("divides by absmax", deq_divides),
        ("codebook rounded to the dtype first", deq_codebook_in_dtype),
        ("keeps the last n codes", deq_last_codes),
        ("always float32", deq_always_float32),
        ("blocksize ignored", deq_fixed_blocksize),
    ],
    "06.lora_linear": [
        ("scaling alpha, not alpha / r", LoRAScalingAlpha),
        ("no kaiming re-init of A", LoRANoReinit),
        ("merge forgets the scaling", LoRAMergeForgetsScaling),
        ("merged forward adds the adapter again", LoRAMergedStillAdds),
        ("base left trainable", LoRABaseTrainable),
        ("alpha // r", LoRAIntegerScaling),
        ("base run under no_grad", LoRABaseUnderNoGrad),
        ("adapter fed a detached input", LoRADetachedInput),
    ],
    "06.predict_qlora_bytes": [
        ("fp32 absmax (no double quant)", predict_fp32_scales),
        ("forgets the LoRA adapters", predict_no_lora),
        ("quantizes lm_head too", predict_quantizes_lm_head),
        ("one byte per 4-bit code", predict_half_a_byte_is_a_byte),
        ("tied embeddings twice / fp32 biases", predict_counts_tied_twice),
        ("second-level scales forgotten", predict_no_second_level),
        ("per-layer offset forgotten", predict_no_offset),
        ("padding once for the model, not per tensor", predict_padding_once),
        ("n // 2 code bytes", predict_floor_half),
    ],
}


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
import functools  # noqa: E402


@functools.lru_cache(maxsize=None)
def codebook_cached(offset=None):
    """lru_cache around the right derivation: every caller gets the one tensor (and may overwrite it)."""
    return quant.nf4_codebook(offset)


def codes_scale_in_place(w, blocksize=64):
    """Divides the caller's weight by its absmax in place to save a copy."""
    q, absmax = quant.nf4_codes(w, blocksize)
    with torch.no_grad():
        w.div_(w.abs().max().clamp_min(1e-12))
    return q, absmax


def codes_flat_view(w, blocksize=64):
    """w.view(-1) (every graded weight is contiguous): a transposed or strided weight raises."""
    return quant.nf4_codes(w.view(-1), blocksize)


def pack_pads_in_place(q, pad=7):
    """Pads the caller's codes in place (resize_ + fill) instead of a new tensor."""
    n = q.numel()
    if n % 2:
        q.resize_(n + 1)
        q[n] = pad
    return quant.pack_nibbles(q[:n], pad)


def deq_scales_absmax_in_place(packed, absmax, shape, dtype=torch.float32, blocksize=64):
    """Reuses the caller's absmax as scratch (absmax.mul_ then div_): float rounding leaves it changed."""
    out = quant.dequantize_nf4(packed, absmax, shape, dtype, blocksize)
    with torch.no_grad():
        absmax.mul_(3.0).div_(3.0001)
    return out


class LoRACountedInstances(_LoRABase):
    """Counts its instances on the class (for unique adapter names): class state that grows with every layer."""

    made = 0

    def __init__(self, base, r=8, alpha=16, dropout=0.0):
        super().__init__(base, r, alpha, dropout)
        LoRACountedInstances.made += 1


MUTANTS["06.nf4_codebook"] += [("one cached tensor for every call (lru_cache)", codebook_cached)]
MUTANTS["06.nf4_codes"] += [("weight scaled in place", codes_scale_in_place), ("view(-1) of the weight", codes_flat_view)]
MUTANTS["06.pack_nibbles"] += [("pads the caller's codes in place", pack_pads_in_place)]
MUTANTS["06.dequantize_nf4"] += [("absmax used as scratch", deq_scales_absmax_in_place)]
MUTANTS["06.lora_linear"] += [("instances counted on the class", LoRACountedInstances)]


# ----------------------------------------------------------------------------- issue 35: one mutant of each kind
# (tests/course/test_mutants.py: a hygiene mutant is caught by a hygiene probe, a constants or space mutant by the
# drawn cases with the hand-picked edges off)


def codes_blocksize_64(w, blocksize=64):
    """Blocks of 64 whatever the caller asks (bitsandbytes' QLoRA default, every first graded case's)."""
    from memlab.quant import nf4_codes

    return nf4_codes(w, 64)


def _lora_counted():
    from memlab.quant.lora import LoRALinear

    return _counted_on_the_class(LoRALinear)


def _lora_two_dim_inputs():
    from memlab.quant.lora import LoRALinear

    class TwoDim(LoRALinear):
        """The adapter's path computed on x.view(-1, in_features) and added as (batch, out): right for a (batch,
        features) input only."""

        def forward(self, x):
            if getattr(self, "merged", False):
                return self.base(x)
            flat = x.reshape(-1, x.shape[-1])
            return self.base(x) + (self.lora_B(self.lora_A(flat)) * self.scaling).reshape(x.shape[0], -1)

    return TwoDim


def _qlora_memo():
    from memlab.quant.lora import predict_qlora_bytes

    return _memoised(predict_qlora_bytes, key=lambda model, r=8, **k: (sum(p.numel() for p in model.parameters()), r))


MUTANTS["06.nf4_codes"] += [("blocks of 64 whatever the blocksize", codes_blocksize_64)]
MUTANTS["06.lora_linear"] += [("instances counted on the class (a registry)", _lora_counted()),
                              ("inputs of one leading dimension only", _lora_two_dim_inputs())]
MUTANTS["06.predict_qlora_bytes"] += [("memoised by parameter count in a dict kept between calls", _qlora_memo())]

KINDS = {
    "06.nf4_codebook": {"hygiene": ["one cached tensor for every call (lru_cache)"],
                        "constants": ["pasted: ignores offset"]},
    "06.nf4_codes": {"hygiene": ["weight scaled in place"], "constants": ["blocks of 64 whatever the blocksize"],
                     "space": ["ties go to the upper level", "view(-1) of the weight", "blocks per row"]},
    "06.pack_nibbles": {"hygiene": ["pads the caller's codes in place"], "constants": ["odd count padded with code 0"],
                        "space": ["odd count: last code dropped"]},
    "06.dequantize_nf4": {"hygiene": ["absmax used as scratch"], "constants": ["blocksize ignored"],
                          "space": ["multiplies in the 16-bit dtype"]},
    "06.lora_linear": {"hygiene": ["instances counted on the class (a registry)"], "constants": ["alpha // r"],
                       "space": ["inputs of one leading dimension only"]},
    "06.predict_qlora_bytes": {"hygiene": ["memoised by parameter count in a dict kept between calls"],
                               "constants": ["n // 2 code bytes"], "space": ["tied embeddings twice / fp32 biases"]},
}
NOT_APPLICABLE = {"06.nf4_codebook": {"space": "one float in (0.5, 1) is the whole input: a codebook pasted for one "
                                               "offset is the constants mutant"}}


# right answers written another way (the over-specific kind): each must PASS
def pack_nibbles_by_arithmetic(q, pad=7):
    """High nibble times 16 plus low nibble, on a padded copy."""
    q = q.reshape(-1).to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_full((1,), pad)])
    return (q[0::2] * 16 + q[1::2]).to(torch.uint8)


RIGHT_ANSWERS = {"06.pack_nibbles": [("high * 16 + low", pack_nibbles_by_arithmetic)]}
