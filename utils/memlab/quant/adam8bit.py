"""Adam with 8-bit blockwise moments (Dettmers, Lewis, Shleifer, Zettlemoyer 2022, arXiv:2110.02861)."""
from __future__ import annotations

import math

import torch

from memlab.core.validation import check_number, invalid
from memlab.quant.blockwise import check_blocksize, dequantize_blockwise, quantize_blockwise
from memlab.quant.codebooks import cached_codebook

__all__ = ["Adam8bit"]


class Adam8bit(torch.optim.Optimizer):
    """Adam with both moments stored in 8 bits, blockwise (Dettmers, Lewis, Shleifer, Zettlemoyer 2022,
    "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861).

    Each step: dequantize ``m`` (signed dynamic map) and ``v`` (unsigned dynamic map) with their
    per-block absmax, do the fp32 Adam update (decoupled weight decay, bias corrections)

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
        p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps),

    and requantize both moments (blocksize 256). A parameter with fewer than ``min_8bit_size``
    (4096) elements keeps fp32 moments, as bitsandbytes does. State: 2 bytes per parameter plus
    2 x 4 bytes per 256-value block (2.03 B/param) instead of 8.
    Follows bitsandbytes/backends/cpu/ops.py ``_optimizer_update_8bit_blockwise_cpu`` and
    ``_optimizer_update_32bit_cpu``; bitsandbytes requantizes with a C lookup routine whose code
    can differ from the exact nearest level by one step near a midpoint, so parameters agree
    within a tolerance, not bitwise.

    ``lr``, ``eps`` and ``weight_decay`` are >= 0, each of ``betas`` in [0, 1).

    Raises:
        ValueError: naming the argument, its value and what is allowed.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, blocksize: int = 256, min_8bit_size: int = 4096) -> None:
        check_number("lr", lr, minimum=0.0)
        if not (len(betas) == 2 and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise invalid("betas", betas, "two numbers in [0, 1)")
        check_number("eps", eps, minimum=0.0)
        check_number("weight_decay", weight_decay, minimum=0.0)
        check_blocksize(blocksize)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.blocksize, self.min_8bit_size = blocksize, min_8bit_size
        self.qmap1, self.qmap2 = cached_codebook("dynamic", "cpu"), cached_codebook("udynamic", "cpu")

    def _init(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        st["step"] = 0
        if p.numel() < self.min_8bit_size:
            st["state1"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            st["state2"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        else:
            blocks = -(-p.numel() // self.blocksize)
            st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
            st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
            st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam update of every parameter with a gradient; returns the closure's loss, or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p] if p in self.state else self._init(p)
                st["step"] += 1
                t = st["step"]
                g = p.grad.float()
                pf = p.data.float()
                c1, c2 = 1.0 - b1**t, math.sqrt(1.0 - b2**t)
                if wd > 0.0:
                    pf.mul_(1.0 - lr * wd)
                if st["state1"].dtype == torch.float32:  # small tensor: bitsandbytes' 32-bit formula
                    m, v = st["state1"], st["state2"]
                    m.mul_(b1).add_(g, alpha=1.0 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                    pf.add_(m / (v.sqrt() + eps * c2), alpha=-lr * c2 / c1)
                else:
                    bs = self.blocksize
                    q1, q2 = self.qmap1.to(p.device), self.qmap2.to(p.device)
                    m = dequantize_blockwise(st["state1"], st["absmax1"], q1, bs)
                    v = dequantize_blockwise(st["state2"], st["absmax2"], q2, bs)
                    m.mul_(b1).add_(g, alpha=1.0 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                    pf.addcdiv_(m, (v.sqrt() / c2).add_(eps), value=-lr / c1)
                    st["state1"], st["absmax1"] = quantize_blockwise(m, q1, bs)
                    st["state2"], st["absmax2"] = quantize_blockwise(v, q2, bs)
                p.data.copy_(pf)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``Optimizer.load_state_dict`` casts every floating parameter's state to the parameter's dtype:
        the uint8 codes would become moments of the wrong meaning (or bf16) and the fp32 moments of small tensors
        fp16/bf16 (and the next step would take the 8-bit branch). The state is loaded, then each tensor is put back
        in the dtype it was saved in (copied from the saved values, never a round trip through the cast).
        """
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for k, v in saved.get(pid, {}).items():
                if isinstance(v, torch.Tensor) and k != "step":
                    self.state[p][k] = v.to(device=p.device, copy=True)

    def __getstate__(self) -> dict:
        """deepcopy and pickle keep the block size and the 8-bit threshold (torch's Optimizer keeps only
        defaults, state and param_groups); the quantization maps are rebuilt on load."""
        state = super().__getstate__()
        state.update(blocksize=self.blocksize, min_8bit_size=self.min_8bit_size)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.qmap1, self.qmap2 = cached_codebook("dynamic", "cpu"), cached_codebook("udynamic", "cpu")

    def state_bytes(self) -> int:
        """Bytes of all optimizer state tensors (the moments and their block scales)."""
        return sum(x.numel() * x.element_size() for st in self.state.values() for x in st.values()
                   if isinstance(x, torch.Tensor))
