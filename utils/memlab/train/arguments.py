"""BudgetTrainer's arguments and data, checked before any work, in memlab's one error format.

Every argument of :class:`~memlab.train.BudgetTrainer` (and of ``train``/``run_step``) is checked
here first -- type, finiteness, range -- with the helpers of :mod:`memlab.core.validation`
(``name=value is invalid; allowed: ...``), before a model is built, a seed set or a directory
touched. A wrong type is a ``TypeError``, a wrong value a ``ValueError``, both in that format.

Bounds that keep big work from starting by accident: every count fits an int64 (what torch and the
checkpoint's tensors hold); ``seed`` is at most ``2**32 - 1`` (NumPy's seeds); ``effective_batch x
seq_len`` is at most ``2**31`` tokens per optimizer step; the default model (a small TinyGPT) takes
``seq_len`` up to 4,096 and a TinyGPT no more than its ``block_size``.

The data is checked against the model's vocabulary when the trainer starts (a corpus tensor whole; a
``data(step)`` function at its first batch, then each batch as it is drawn): a token id outside
``0 .. vocab_size - 1`` is refused naming where it is, instead of an ``IndexError`` inside the
embedding (or a CUDA device-side assert).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlab.core.units import parse_size
from memlab.core.validation import check_bool, check_int, check_number, invalid

__all__ = ["INT64_MAX", "MAX_SEED", "MAX_TOKENS_PER_STEP", "DEFAULT_MODEL_MAX_SEQ", "IGNORE_INDEX",
           "check_arguments", "check_steps", "vocab_size", "check_corpus", "check_batch"]

INT64_MAX = 2**63 - 1
MAX_SEED = 2**32 - 1
MAX_TOKENS_PER_STEP = 2**31
DEFAULT_MODEL_MAX_SEQ = 4096
IGNORE_INDEX = -100  # a target F.cross_entropy (and memlab.loss) leaves out
_BUDGET_ALLOWED = f"None, an int number of bytes from 1 to {INT64_MAX:,}, or a size such as '64 MiB'"


class _Shown:
    # Stands for a value whose repr cannot be written (an int of more digits than Python converts).
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > 10_000:
        return _Shown(f"<an int of {value.bit_length():,} bits>")
    return value


def _number(name: str, value: Any, *, minimum: float, strict_minimum: bool = False) -> float:
    # check_number, also for an int too large for a float (10**400): check_number's math.isfinite would
    # raise OverflowError on it; here it is refused like inf.
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        raise invalid(name, _shown(value), f"a finite number {'>' if strict_minimum else '>='} {minimum}")
    return check_number(name, value, minimum=minimum, strict_minimum=strict_minimum)


def _int(name: str, value: Any, minimum: int, maximum: int = INT64_MAX) -> int:
    return check_int(name, _shown(value) if isinstance(value, int) else value, minimum=minimum, maximum=maximum)


def _type_error(name: str, value: Any, allowed: str) -> TypeError:
    return TypeError(str(invalid(name, value, allowed)))


def _budget(budget: Any) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, str):
        try:
            b = parse_size(budget, name="budget")
        except OverflowError:  # parse_size("1e300 GiB"): a finite number of units, more bytes than a float holds
            b = INT64_MAX + 1
        if b > INT64_MAX:
            raise invalid("budget", budget, _BUDGET_ALLOWED)
        return b
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise _type_error("budget", _shown(budget), _BUDGET_ALLOWED)
    if not 1 <= budget <= INT64_MAX:
        raise invalid("budget", _shown(budget), _BUDGET_ALLOWED)
    return budget


def _ckpt_dir(ckpt_dir: Any) -> Path | None:
    if ckpt_dir is None:
        return None
    if not isinstance(ckpt_dir, (str, os.PathLike)) or isinstance(ckpt_dir, bytes):
        raise _type_error("ckpt_dir", _shown(ckpt_dir), "None, or a directory path (str or os.PathLike)")
    text = os.fspath(ckpt_dir)
    if not isinstance(text, str) or not text.strip() or "\0" in text:
        raise invalid("ckpt_dir", ckpt_dir, "None, or a non-empty directory path")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise invalid("ckpt_dir", ckpt_dir, "a directory (this path is a file), or None")
    return path


def check_arguments(*, model: Any, budget: Any, data: Any, effective_batch: Any, seq_len: Any, ckpt_dir: Any,
                    seed: Any, lr: Any, weight_decay: Any, ckpt_interval: Any, keep: Any, progress: Any,
                    fresh: Any) -> dict[str, Any]:
    """Every scalar argument of :class:`~memlab.train.BudgetTrainer` checked (``stacks`` is checked by the
    trainer): the normalised values (``budget`` in bytes, ``ckpt_dir`` a Path or None, ``lr`` and
    ``weight_decay`` floats). Raises TypeError or ValueError naming the argument, its value and what is
    allowed."""
    from memlab.models import TinyGPT

    if model is not None and not isinstance(model, nn.Module):
        raise _type_error("model", _shown(model), "None (a small TinyGPT) or a torch.nn.Module")
    eb = _int("effective_batch", effective_batch, 1)
    t = _int("seq_len", seq_len, 1)
    if model is None and t > DEFAULT_MODEL_MAX_SEQ:
        raise invalid("seq_len", t, f"an int from 1 to {DEFAULT_MODEL_MAX_SEQ:,} for the default model (a small "
                                    "TinyGPT); pass a model for longer sequences")
    if isinstance(model, TinyGPT) and t > model.config.block_size:
        raise invalid("seq_len", t, f"an int from 1 to the model's block_size={model.config.block_size}")
    if eb * t > MAX_TOKENS_PER_STEP:
        raise invalid("effective_batch", eb, f"effective_batch x seq_len <= {MAX_TOKENS_PER_STEP:,} tokens per "
                                             f"optimizer step (seq_len={t})")
    if not (data is None or isinstance(data, torch.Tensor) or callable(data)):
        raise _type_error("data", _shown(data), "None (the standard-library corpus), a 1-D tensor of token ids, "
                                                "or a function step -> (x, y)")
    if isinstance(data, torch.Tensor):
        _corpus_shape(data, t)
    out = {"budget": _budget(budget), "ckpt_dir": _ckpt_dir(ckpt_dir), "effective_batch": eb, "seq_len": t,
           "seed": _int("seed", seed, 0, MAX_SEED),
           "lr": _number("lr", lr, minimum=0, strict_minimum=True),
           "weight_decay": _number("weight_decay", weight_decay, minimum=0),
           "ckpt_interval": _int("ckpt_interval", ckpt_interval, 1),
           "keep": _int("keep", keep, 2),  # the newest and a fallback
           "progress": check_bool("progress", progress), "fresh": check_bool("fresh", fresh)}
    return out


def check_steps(name: str, steps: Any) -> int:
    """``steps`` (of ``train``, ``run_step``): an int from 0 to 2**63 - 1."""
    return _int(name, steps, 0)


# ----------------------------------------------------------------------------- the data and the vocabulary
def _corpus_shape(corpus: torch.Tensor, seq_len: int) -> None:
    from memlab.models.corpus import split_bounds

    if corpus.dim() != 1 or corpus.dtype == torch.bool or corpus.is_floating_point() or corpus.is_complex():
        raise invalid("data", _Shown(f"<tensor of shape {tuple(corpus.shape)}, {corpus.dtype}>"),
                      "a 1-D tensor of integer token ids, a function step -> (x, y), or None")
    lo, hi = split_bounds(corpus.numel(), "train")
    if hi - lo < seq_len + 2:
        raise invalid("data", _Shown(f"<tensor of {corpus.numel():,} tokens>"),
                      f"a corpus whose train split (its first 90%, {hi - lo:,} tokens here) holds at least "
                      f"seq_len + 2 = {seq_len + 2:,} tokens")


def vocab_size(model: nn.Module) -> int | None:
    """The number of token ids ``model`` embeds: its input embedding's rows (TinyGPT's ``tok_emb``, a
    ``transformers`` model's ``get_input_embeddings()``), else ``config.vocab_size``; None when unknown."""
    for get in (lambda: model.get_input_embeddings(), lambda: getattr(model, "tok_emb")):
        try:
            emb = get()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if isinstance(emb, nn.Embedding):
            return emb.num_embeddings
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _first_outside(t: torch.Tensor, vocab: int, ignore: bool) -> tuple[int, int] | None:
    # (flat index, id) of the first id of ``t`` outside 0..vocab-1 (IGNORE_INDEX allowed if ``ignore``), or None
    t = t.detach()
    if t.numel() == 0 or (int(t.min()) >= 0 and int(t.max()) < vocab):  # two 0-d results: the usual case
        return None
    bad = (t < 0) | (t >= vocab)
    if ignore:
        bad &= t != IGNORE_INDEX
    if not bool(bad.any()):
        return None
    i = int(bad.reshape(-1).nonzero()[0, 0])
    return i, int(t.reshape(-1)[i])


def check_corpus(corpus: torch.Tensor, vocab: int | None, *, offset: int = 0) -> None:
    """Refuse a corpus with a token id outside the model's vocabulary, naming its position (plus ``offset``,
    where ``corpus`` is a slice) and the id."""
    if vocab is None:
        return
    found = _first_outside(corpus, vocab, ignore=False)
    if found is not None:
        pos, tok = found[0] + offset, found[1]
        raise invalid(f"data[{pos}]", tok, f"token ids 0 to {vocab - 1} (the model's vocabulary has {vocab:,}); "
                                            "the corpus holds an id the model cannot embed")


def check_batch(step: int, x: Any, y: Any, shape: tuple[int, int], vocab: int | None) -> None:
    """Check ``data(step)``'s batch: two long tensors of ``shape``, ids within the vocabulary (a target
    may also be IGNORE_INDEX); the error names the step, the tensor, the row, the position and the id."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or tuple(x.shape) != shape \
            or x.shape != y.shape:
        got = [tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in (x, y)]
        raise ValueError(f"data({step}) returned x {got[0]}, y {got[1]}; expected both {shape}")
    for name, t in (("x", x), ("y", y)):
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise ValueError(f"data({step}) returned {name} of dtype {t.dtype}; expected integer token ids")
        if vocab is None:
            continue
        found = _first_outside(t, vocab, ignore=name == "y")
        if found is not None:
            i, tok = found
            row, pos = divmod(i, shape[1])
            extra = f" or {IGNORE_INDEX} (ignored)" if name == "y" else ""
            raise invalid(f"data({step}): {name}[{row}, {pos}]", tok,
                          f"token ids 0 to {vocab - 1}{extra}: the model's vocabulary has {vocab:,} ids")
