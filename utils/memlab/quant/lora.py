"""LoRA: low-rank adapters on a frozen linear layer, and QLoRA when the base is a Linear4bit.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685):
the frozen weight W (out x in) gets a trainable low-rank update,

    y = x W^T + b  +  (alpha / r) * dropout(x) A^T B^T,      A: r x in,  B: out x r,

with A initialised like nn.Linear (kaiming-uniform, a = sqrt(5)) and B = 0, so training starts
from the base model exactly. Only A and B (r * (in + out) numbers per layer) need gradients and
optimizer state. ``merge()`` folds ``(alpha / r) * B A`` into W for inference; ``unmerge()``
subtracts it again. QLoRA (Dettmers et al. 2023) is the same adapter on an NF4 base
(:class:`memlab.quant.Linear4bit`).

Written to match peft's ``LoraLayer`` / ``lora.Linear`` (peft/tuners/lora/layer.py): same
initialisation order (two nn.Linear constructions, then kaiming A and zero B), same forward
(``result + lora_B(lora_A(dropout(x))) * scaling`` with x cast to A's dtype, result cast back to
the base output's dtype) and the same merge arithmetic (``W += (B @ A) * scaling``).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from memlab.core.validation import check_positive_int, invalid
from memlab.quant.linear4bit import Linear4bit

__all__ = ["LoRALinear", "add_lora", "lora_parameters", "count_trainable", "quantize_model", "qlora_model",
           "model_storage_bytes", "predict_qlora_bytes"]


class LoRALinear(nn.Module):
    """A frozen ``base`` (nn.Linear or memlab.quant.Linear4bit) plus a rank-``r`` adapter scaled by ``alpha / r``.

    Args:
        base: the layer to adapt; its parameters are frozen.
        dropout: dropout on the adapter's input, in [0, 1).
        dtype: the adapter's dtype (QLoRA keeps it float32 over a bf16-computing base).

    Raises:
        TypeError: for a base that is neither.
        ValueError: for a bad ``r`` or ``dropout``.
    """

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16, dropout: float = 0.0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not isinstance(base, (nn.Linear, Linear4bit)):
            raise TypeError(f"LoRALinear: base={type(base).__name__} is invalid; allowed: an nn.Linear or "
                            f"memlab.quant.Linear4bit")
        check_positive_int("r", r)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise invalid("dropout", dropout, "a float with 0 <= dropout < 1")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # peft's order: build both nn.Linear (each draws its default init), then re-init A, zero B
        self.lora_A = nn.Linear(self.in_features, r, bias=False, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.merged = False

    def delta_weight(self) -> torch.Tensor:
        """What :meth:`merge` adds to the base weight: ``(B @ A) * scaling``, ``(out_features, in_features)``."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output plus the scaled adapter's (just the base's once merged), in the base
        output's dtype."""
        result = self.base(x)
        if self.merged:
            return result
        out_dtype = result.dtype
        h = self.dropout(x.to(self.lora_A.weight.dtype))
        result = result + self.lora_B(self.lora_A(h)) * self.scaling
        return result.to(out_dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into the base weight (an NF4 base is dequantized, updated and requantized: lossy).

        Raises:
            RuntimeError: when already merged.
        """
        if self.merged:
            raise RuntimeError("LoRALinear.merge: already merged")
        self._add_to_base(self.delta_weight())
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the adapter from the base weight again (exact inverse up to rounding for nn.Linear).

        Raises:
            RuntimeError: when not merged.
        """
        if not self.merged:
            raise RuntimeError("LoRALinear.unmerge: not merged")
        self._add_to_base(-self.delta_weight())
        self.merged = False

    def _add_to_base(self, delta: torch.Tensor) -> None:
        if isinstance(self.base, nn.Linear):
            self.base.weight.data += delta.to(self.base.weight.dtype)
        else:
            w = self.base.dequantized_weight(torch.float32) + delta.float()
            self.base.quantize_(w)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}, merged={self.merged}"


def add_lora(model: nn.Module, r: int = 8, alpha: float = 16, target_modules: Iterable[str] = ("q_proj", "v_proj"),
             dropout: float = 0.0) -> nn.Module:
    """Wrap every nn.Linear / Linear4bit whose name ends in one of ``target_modules`` in a LoRALinear, in place.

    All other parameters are frozen (requires_grad=False), as peft's get_peft_model does.
    Modules are wrapped in ``named_modules()`` order, so the random initialisation matches peft's
    under the same seed. ``target_modules`` are leaf names (a single string is one name). Returns ``model``.

    Raises:
        ValueError: when ``target_modules`` is empty or matches nothing (a typo is otherwise silent).
    """
    targets = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
    if not targets:
        raise invalid("add_lora: target_modules", target_modules, "a non-empty list of layer names")
    for p in model.parameters():
        p.requires_grad_(False)
    found = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets and isinstance(module, (nn.Linear, Linear4bit)):
            found.append(name)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, leaf, LoRALinear(module, r=r, alpha=alpha, dropout=dropout))
    if not found:
        raise invalid("add_lora: target_modules", targets, "names of nn.Linear or Linear4bit layers in the model "
                      "(no nn.Linear or Linear4bit has one of these names)")
    return model


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters, what the optimizer gets: lora_A and lora_B of every LoRALinear, in module order."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A.weight, m.lora_B.weight)]


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameters; a Linear4bit's weight (a buffer) counts by its element count."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear4bit))
    return trainable, total


# ----------------------------------------------------------------------------- the QLoRA model and its bytes
def quantize_model(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16, blocksize: int = 64,
                   double_quant: bool = True, skip: Iterable[str] = ("lm_head",)) -> nn.Module:
    """Replace every nn.Linear (except those named in ``skip``) by a Linear4bit, in place.

    As transformers' ``BitsAndBytesConfig(load_in_4bit=True)`` does (it keeps lm_head in 16/32 bit).
    Returns ``model``.
    """
    skip = tuple(skip)
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf not in skip:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, leaf, Linear4bit.from_linear(module, compute_dtype, blocksize, double_quant))
    return model


def qlora_model(model: nn.Module, r: int = 8, alpha: float = 16, skip: Iterable[str] = ("lm_head",)) -> nn.Module:
    """QLoRA as in the paper: every linear layer (but lm_head) in NF4 and a LoRA adapter on each.

    NF4 with double quant, blocksize 64, bf16 compute; fp32 adapters; ``skip`` leaf names are left in
    floating point and without adapter. Returns ``model``, changed in place.
    """
    quantize_model(model, skip=skip)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, Linear4bit)}
    return add_lora(model, r=r, alpha=alpha, target_modules=sorted(names))


def model_storage_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage held by the model's parameters and buffers (shared storages once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def predict_qlora_bytes(model: nn.Module, r: int = 8, skip: Iterable[str] = ("lm_head",)) -> int:
    """Predict :func:`model_storage_bytes` of ``qlora_model(model, r)`` from the float model, without building it.

    Per quantized linear (n = in*out weights): n/2 code bytes (ceil), one uint8 code per 64-block scale,
    a float32 second-level scale per 256 first-level scales, a float32 offset, the bias in bf16, and
    LoRA's r*(in+out) float32 numbers. Everything else keeps its bytes (tied storages once).
    """
    skip = tuple(skip)
    quantized = {id(m.weight) for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in skip}
    total = 0
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in skip:
            numel = m.in_features * m.out_features
            blocks = -(-numel // 64)
            total += -(-numel // 2) + blocks + 4 * -(-blocks // 256) + 4
            total += 0 if m.bias is None else 2 * m.out_features
            total += 4 * r * (m.in_features + m.out_features)
    seen = set()
    for n, m in model.named_modules():
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in skip:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen or id(t) in quantized:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
