"""The trainer's plumbing: the budget argument, the data windows, the attention switch, the RNG states."""
from __future__ import annotations

import random
from typing import Any, Callable

import torch
from torch import nn

from memlab.core.units import parse_size
from memlab.core.validation import invalid


def _parse_budget(budget: Any) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, str):
        return parse_size(budget, name="budget")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise invalid("budget", budget, "None, an int number of bytes >= 1, or a size such as '64 MiB'")
    return budget


def _set_attention(model: nn.Module, attention: str) -> None:
    from memlab.models import TinyGPT

    if isinstance(model, TinyGPT):
        impl = "manual" if attention == "eager" else "sdpa"
        for block in model.blocks:
            block.attn.attention = impl
        return
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(attention)
    elif hasattr(getattr(model, "config", None), "_attn_implementation"):
        model.config._attn_implementation = attention


def _corpus_data(corpus: torch.Tensor, seq_len: int, effective_batch: int, seed: int) -> Callable[[int], tuple]:
    from memlab.models.corpus import split_bounds

    if corpus.dim() != 1:
        raise ValueError(f"data: a corpus must be a 1-D tensor of token ids, got shape {tuple(corpus.shape)}")
    lo, hi = split_bounds(corpus.numel(), "train")
    train = corpus[lo:hi]
    if train.numel() < seq_len + 2:
        raise ValueError(f"data: the train split has {train.numel()} tokens; seq_len={seq_len} needs at least "
                         f"{seq_len + 2}")
    window = torch.arange(seq_len + 1)
    n_starts = train.numel() - seq_len

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, n_starts, (effective_batch,), generator=g)
        chunk = train[starts[:, None] + window].long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    return batch


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        s = np.random.get_state()
        state["numpy"] = [s[0], s[1].tolist(), int(s[2]), int(s[3]), float(s[4])]
    except ImportError:  # pragma: no cover
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    v = state["python"]
    random.setstate((v[0], tuple(v[1]), v[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4]))

