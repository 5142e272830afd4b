"""Train under a memory budget: back off on OOM, resume from a checkpoint, lose nothing (chapter 07).

:class:`BudgetTrainer` runs a list of training stacks (:class:`memlab.plan.Stack`, most
memory-hungry first, as a planner ranks them) on a real model and real data, and keeps the run
inside ``budget`` bytes:

* **the budget is enforced, not hoped for.** On CUDA the allocator itself refuses: the trainer
  sets ``torch.cuda.set_per_process_memory_fraction(budget / total)`` while ``train()`` runs, and
  an allocation beyond it raises ``torch.OutOfMemoryError`` (the limit is on the caching
  allocator's reserved bytes, so ``max_memory_allocated <= budget``; the CUDA context is outside).
  On the CPU :class:`BudgetTracker` (a :class:`memlab.profiler.MemoryTracker` that sees every
  storage an op creates) raises the same
  ``torch.OutOfMemoryError`` as soon as the live tensor bytes -- parameters, gradients, optimizer
  state, activations, the batch -- would exceed ``budget``; a refused total never counts toward the
  peak, as a refused ``cudaMalloc`` never counts toward ``max_memory_allocated``.
* **on OOM it backs off**: frees what the failed step held, moves to the next stack (a smaller
  micro-batch with more gradient accumulation, the same effective batch; then checkpointing), and
  restores the last checkpoint (model, optimizer state, RNG states, data position, loss history),
  so the failed step is re-run from a state that is bitwise the one before it. Each back-off is a
  :class:`Backoff` event in ``.backoffs``.
* **it checkpoints with** :mod:`memlab.ckpt` (one safetensors file, atomic rename, SHA-256
  verified) every ``ckpt_interval`` optimizer steps; a new ``BudgetTrainer`` on the same
  ``ckpt_dir`` resumes from the newest complete checkpoint, after a crash or ``kill -9`` at any
  instant, with nothing lost or repeated. Checkpoints are written between optimizer steps,
  outside the budgeted step (from host memory: on a GPU the state is copied to the host).

The one formula: with ``k`` equal micro-batches and mean losses, the accumulated gradient
``g = (1/k) * sum_j grad L(micro-batch j)`` is the gradient of the mean loss of the whole effective
batch, so ``micro_batch * grad_accum`` is all that training sees (gradient accumulation). The
stacks' other knobs are those of chapters 02-06 (checkpointing: Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost", arXiv:1604.06174).

What "the same losses" means. The data is addressed by position: optimizer step ``i`` always
draws the same ``effective_batch`` windows (a generator seeded with ``seed`` and ``i``), whatever
the micro-batch, so a restore only needs the step number. Given the state after step ``i``, step
``i + 1`` with one stack is a deterministic function on the CPU, so a run that was interrupted
(OOM back-off or ``kill -9``) and resumed gives **bitwise** the losses of an uninterrupted run
that used each stack for the same steps; an OOM in the first step (the usual case: a stack that
does not fit never fits) gives bitwise the uninterrupted run of the final stack.
Two *different* micro-batch splits of the same effective batch compute the same mathematical
gradient, ``sum_j (1/k) grad(mean loss of micro-batch j)``, but not with the same floating-point
additions: a matmul's weight gradient sums over batch x sequence in one reduction for the whole
batch and in ``k`` partial reductions plus ``k - 1`` additions with accumulation, and fp32
addition is not associative. So a stack change in mid-run moves the losses by rounding only:
micro-batch 8 against 8 micro-batches of 1, TinyGPT (2 layers, width 32), 12 steps, measured on a
2-core x86 CPU: at most 1.9e-7 relative
(``tests/test_train.py::test_micro_batch_split_changes_losses_by_rounding_only`` prints it and
asserts < 1e-5).

Stacks this trainer runs (other values are errors that say so): precision ``fp32`` or
``bf16-mixed`` (autocast); checkpointing ``none``, ``every-k`` or ``full`` (each chosen block's
forward is recomputed in backward, torch's non-reentrant ``checkpoint``); optimizer ``adamw`` or
``adamw-fused``; adapter ``full``; attention ``eager`` or ``sdpa`` (applied to TinyGPT and to
``transformers`` models).

:func:`bucket_batches` groups variable-length sequences of similar length into batches, which
cuts the padding (and the activation memory padding costs) against random batching
(:func:`padding_stats` counts both). On the standard library's source lines in batches of 32,
padding is 56% of the padded slots with random batches, 15% with pools of 8 batches and 0.9%
fully sorted; the tracked forward + backward peaks of TinyGPT summed over 72 lines in batches of 8
are 26% lower bucketed (``tests/test_train.py`` prints both).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import random
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from memlab import ckpt as _ckpt
from memlab.accounting import format_bytes
from memlab.models import decoder_layers
from memlab.plan import Stack
from memlab.profiler import MemoryTracker

__all__ = ["BudgetTrainer", "BudgetTracker", "Backoff", "back_off", "bucket_batches", "random_batches",
           "padding_stats", "pad_batch", "measure_stack_peak", "estimate_stack_peak", "cheapest_stack",
           "back_off_chain", "SUPPORTED"]

SUPPORTED: dict[str, tuple[str, ...]] = {
    "precision": ("fp32", "bf16-mixed"),
    "checkpointing": ("none", "every-k", "full"),
    "optimizer": ("adamw", "adamw-fused"),
    "adapter": ("full",),
    "attention": ("eager", "sdpa"),
}
_CKPT_GLOB = "step-*.safetensors"


# ----------------------------------------------------------------------------- budget on the CPU
class BudgetTracker(MemoryTracker):
    """A :class:`~memlab.profiler.MemoryTracker` that raises ``torch.OutOfMemoryError`` when the
    live tracked bytes would exceed ``budget``, the CPU stand-in for the CUDA allocator's refusal.

    The check runs after every dispatched op (and when entering the block, where the model and
    the optimizer state alone may be too big). A total over the budget raises before it can
    become the peak, so ``peak_bytes <= budget`` always holds; ``refused_bytes`` is the total
    that was refused (0 if none).
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
                 budget: int, device: str | torch.device | None = None, timeline: bool = False) -> None:
        super().__init__(model, optimizer, device=device, timeline=timeline)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"budget={budget!r} is invalid; allowed: a number of bytes, an int > 0")
        self.budget = budget
        self.refused_bytes = 0
        self._enforce = True

    def after_op(self) -> bool | None:
        total = self.current_bytes
        if total > self.budget:
            if not self._enforce:  # unwinding after a refusal: the refused bytes never become the peak
                return False
            self.refused_bytes = total
            self._enforce = False  # the unwinding that follows must not raise again
            raise torch.OutOfMemoryError(
                f"budget {format_bytes(self.budget)} ({self.budget} B) exceeded: live tensors would hold "
                f"{format_bytes(total)} ({total} B) (memlab.train.BudgetTracker, CPU)")
        return None

    def __enter__(self) -> "BudgetTracker":
        self._enforce = True
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        self._enforce = False
        super().__exit__(*exc)


# ----------------------------------------------------------------------------- back-off
@dataclass(frozen=True)
class Backoff:
    """One OOM back-off: at optimizer step ``step`` stack ``from_stack`` ran out of memory
    (``reason``), the trainer moved to ``to_stack`` and restored the checkpoint of step ``restored``."""

    step: int
    from_stack: Stack
    to_stack: Stack
    reason: str
    restored: int

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "from_stack": dataclasses.asdict(self.from_stack),
                "to_stack": dataclasses.asdict(self.to_stack), "reason": self.reason, "restored": self.restored}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Backoff":
        return cls(d["step"], Stack(**d["from_stack"]), Stack(**d["to_stack"]), d["reason"], d["restored"])


def back_off(stack: Stack) -> Stack | None:
    """The next stack to try after ``stack`` ran out of memory, keeping the effective batch.

    The rule: first shrink the micro-batch to the largest divisor of the effective batch that is
    at most half the current one (activations scale with the micro-batch; gradient accumulation
    keeps ``micro_batch * grad_accum`` equal); once the micro-batch is 1, turn on full
    checkpointing; after that, ``None`` (nothing left to give). Every other knob is kept.

    >>> back_off(Stack(micro_batch=18, grad_accum=1)).micro_batch, back_off(Stack(micro_batch=9, grad_accum=2)).micro_batch
    (9, 3)
    """
    if not isinstance(stack, Stack):
        raise TypeError(f"stack: expected a memlab.plan.Stack, got {type(stack).__name__}")
    eff = stack.effective_batch
    if stack.micro_batch > 1:
        mb = max(d for d in range(1, stack.micro_batch // 2 + 1) if eff % d == 0)
        return dataclasses.replace(stack, micro_batch=mb, grad_accum=eff // mb)
    if stack.checkpointing != "full":
        return dataclasses.replace(stack, checkpointing="full")
    return None


def back_off_chain(stack: Stack) -> list[Stack]:
    """``[stack, back_off(stack), back_off(back_off(stack)), ...]`` until nothing is left."""
    out = [stack]
    while (nxt := back_off(out[-1])) is not None:
        out.append(nxt)
    return out


# ----------------------------------------------------------------------------- helpers
def _parse_budget(budget: Any) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, str):
        from memlab.estimate import parse_size

        try:
            return parse_size(budget)
        except ValueError as exc:
            raise ValueError(f"budget={budget!r} is invalid: {exc}") from None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget={budget!r} is invalid; allowed: None, an int number of bytes > 0, or a size "
                         "string such as '64 MiB'")
    return budget


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid; allowed: an int >= 1")
    return value


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
    from memlab.data import split_bounds

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


# ----------------------------------------------------------------------------- the trainer
class BudgetTrainer:
    """Train ``model`` inside ``budget`` bytes, backing off along ``stacks`` on OOM (see the module doc).

    Args:
        model: an ``nn.Module`` whose loss :func:`memlab.models.lm_loss` computes (TinyGPT, any
            ``transformers`` causal LM), or ``None`` for a small :class:`memlab.models.TinyGPT`
            built under ``torch.manual_seed(seed)``.
        budget: bytes (an int, or a string such as ``"24 MiB"``); ``None`` measures without a limit.
        stacks: the stacks to try, in order (all with ``effective_batch``); after an OOM the next
            one is used. A single :class:`~memlab.plan.Stack` means ``back_off_chain(stack)``.
        data: ``None`` (the standard-library corpus, :func:`memlab.data.stdlib_corpus`), a 1-D
            tensor of token ids (windows are drawn from its first 90%), or ``data(step) -> (x, y)``
            returning ``(effective_batch, seq_len)`` long tensors, a pure function of ``step``.
        effective_batch, seq_len: sequences per optimizer step and tokens per sequence.
        ckpt_dir: where checkpoints go (a temporary directory when ``None``); the newest complete
            checkpoint there is resumed, with its stack and back-off history when that stack is
            in ``stacks`` (else from ``stacks[0]``). The directory belongs to one trainer at a
            time: leftover temp files of a killed writer are removed when a trainer opens it.
        seed: seeds the default model, the data order and the RNGs at the start.
        lr, weight_decay: AdamW's.
        ckpt_interval: optimizer steps between checkpoints (also one at the start and at the end).
        keep: how many complete checkpoints to keep (>= 2, so a corrupted newest one has a fallback),
            counted by step number among the verified ones; the newest verified one is never deleted.
        progress: show a tqdm bar over the optimizer steps.
        fresh: start at step 0 even though ``ckpt_dir`` holds checkpoints: they are renamed to
            ``<name>.set-aside`` (never deleted). Without it, a directory whose checkpoints all
            fail verification is refused (:class:`memlab.ckpt.CheckpointError`), so that a
            corruption never silently restarts a run from step 0.

    Checkpoints that fail verification are skipped (newest first) and renamed to
    ``<name>.corrupt``; one that verifies but belongs to another run (another model's tensors,
    another ``effective_batch``/``seq_len``/``seed``, not a trainer's state) raises
    :class:`~memlab.ckpt.CheckpointError` naming the file. Resuming with another ``lr`` or
    ``weight_decay`` than the checkpoint's applies the new value to the optimizer and warns
    (``hparams_applied`` lists what changed).
    """

    def __init__(self, model: nn.Module | None = None, budget: int | str | None = None, *,
                 stacks: Sequence[Stack] | Stack, data: Any = None, effective_batch: int, seq_len: int,
                 ckpt_dir: str | Path | None = None, seed: int = 0, lr: float = 1e-3, weight_decay: float = 0.0,
                 ckpt_interval: int = 1, keep: int = 2, progress: bool = False, fresh: bool = False) -> None:
        self.effective_batch = _positive_int("effective_batch", effective_batch)
        self.seq_len = _positive_int("seq_len", seq_len)
        self.ckpt_interval = _positive_int("ckpt_interval", ckpt_interval)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise ValueError(f"keep={keep!r} is invalid; allowed: an int >= 2 (the newest and a fallback)")
        self.keep = keep
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} is invalid; allowed: an int >= 0")
        self.seed = seed
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr={lr!r} is invalid; allowed: a finite number > 0")
        if not (isinstance(weight_decay, (int, float)) and not isinstance(weight_decay, bool)
                and math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay={weight_decay!r} is invalid; allowed: a finite number >= 0")
        if not isinstance(fresh, bool):
            raise ValueError(f"fresh={fresh!r} is invalid; allowed: True or False")
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self.budget = _parse_budget(budget)
        self.stacks = self._check_stacks(stacks)
        self.progress = bool(progress)

        from memlab.config import seed_everything

        seed_everything(seed)
        if model is None:
            from memlab.models import TinyGPT, TinyGPTConfig

            model = TinyGPT(TinyGPTConfig(block_size=max(seq_len, 64), n_layer=2, n_head=2, n_embd=64))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
        self.model = model
        self.model.train()
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self._batch = self._make_data(data)

        self._tmp = None
        if ckpt_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="memlab-ckpt-")
            ckpt_dir = self._tmp.name
        self.ckpt_dir = Path(ckpt_dir)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        # temp files of a writer that was killed (the directory is this trainer's alone)
        self.stale_temps_removed = _ckpt.remove_stale_temps(self.ckpt_dir)

        self.step = 0
        self.losses: list[float] = []
        self.backoffs: list[Backoff] = []
        self.step_peaks: list[int] = []  # tracked (CPU) or allocator (CUDA) peak of each committed step
        self.stack_index = 0
        self.resumed_from: Path | None = None
        self.rejected: list[tuple[Path, str]] = []  # checkpoints that failed verification
        self.set_aside: list[Path] = []  # checkpoints renamed out of the way (corrupt, or fresh=True)
        self.hparams_applied: dict[str, tuple[float, float]] = {}  # name: (checkpoint's, now)
        self._applied: Stack | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._apply(self.stacks[0])
        if fresh:
            for path in list(_ckpt.iter_checkpoints(self.ckpt_dir, _CKPT_GLOB)):
                self._set_aside(path, "set-aside")
        latest = self._latest_checkpoint()
        if latest is not None:
            self._restore(latest, resume=True)
        elif self.rejected:
            lines = "; ".join(f"{p.name}: {why.split(': ', 1)[-1]}" for p, why in self.rejected[:5])
            raise _ckpt.CheckpointError(
                f"ckpt_dir={str(self.ckpt_dir)!r}: no checkpoint there verifies ({len(self.rejected)} rejected: "
                f"{lines}); refusing to restart from step 0 over them. Restore a good copy, or pass fresh=True "
                "(--fresh) to set them aside and start from step 0")

    # -------------------------------------------------------------- arguments
    @staticmethod
    def _check_stacks_type(stacks: Any) -> list[Stack]:
        if isinstance(stacks, Stack):
            return back_off_chain(stacks)
        if isinstance(stacks, (str, bytes)) or not isinstance(stacks, Sequence) or len(stacks) == 0:
            raise ValueError(f"stacks={stacks!r} is invalid; allowed: a Stack or a non-empty sequence of "
                             "memlab.plan.Stack")
        for i, s in enumerate(stacks):
            if not isinstance(s, Stack):
                raise TypeError(f"stacks[{i}]: expected a memlab.plan.Stack, got {type(s).__name__}")
        return list(stacks)

    def _check_stacks(self, stacks: Any) -> list[Stack]:
        out = self._check_stacks_type(stacks)
        for i, s in enumerate(out):
            if s.effective_batch != self.effective_batch:
                raise ValueError(f"stacks[{i}]: micro_batch={s.micro_batch} x grad_accum={s.grad_accum} = "
                                 f"{s.effective_batch}; allowed: effective_batch={self.effective_batch}")
            for knob, allowed in SUPPORTED.items():
                if getattr(s, knob) not in allowed:
                    raise ValueError(f"stacks[{i}].{knob}={getattr(s, knob)!r}: BudgetTrainer runs "
                                     f"{', '.join(map(repr, allowed))}")
        return out

    def _make_data(self, data: Any) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        if data is None:
            from memlab.config import pick
            from memlab.data import stdlib_corpus

            data = stdlib_corpus(max_bytes=pick(full=None, small=1 << 20))
        if isinstance(data, torch.Tensor):
            return _corpus_data(data, self.seq_len, self.effective_batch, self.seed)
        if callable(data):
            return data
        raise TypeError(f"data: expected None, a 1-D tensor of token ids or a function step -> (x, y), got "
                        f"{type(data).__name__}")

    # -------------------------------------------------------------- stacks
    @property
    def stack(self) -> Stack:
        """The stack in use now."""
        return self.stacks[self.stack_index]

    def _apply(self, stack: Stack) -> None:
        """Make the model and the optimizer run ``stack`` (checkpointing, attention, optimizer kind)."""
        old = self._applied
        blocks = None
        if old is None or (old.checkpointing, old.ckpt_every) != (stack.checkpointing, stack.ckpt_every):
            if stack.checkpointing != "none" or (old is not None and old.checkpointing != "none"):
                blocks = decoder_layers(self.model)
            if blocks is not None:
                k = 1 if stack.checkpointing == "full" else stack.ckpt_every
                for i, block in enumerate(blocks):
                    block.__dict__.pop("forward", None)  # undo an earlier wrapping
                    if stack.checkpointing != "none" and i % k == 0:
                        block.forward = functools.partial(_torch_checkpoint, type(block).forward.__get__(block),
                                                          use_reentrant=False)
        if old is None or old.attention != stack.attention:
            _set_attention(self.model, stack.attention)
        if self.optimizer is None or old is None or old.optimizer != stack.optimizer:
            params = [p for p in self.model.parameters() if p.requires_grad]
            fused = stack.optimizer == "adamw-fused"
            new = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay,
                                    **({"fused": True} if fused else {"foreach": False}))
            if self.optimizer is not None:
                sd = self.optimizer.state_dict()
                for g in sd["param_groups"]:
                    g["fused"], g["foreach"] = (True, None) if fused else (None, False)
                new.load_state_dict(sd)
            self.optimizer = new
        self._applied = stack

    # -------------------------------------------------------------- checkpoints
    def _ckpt_path(self, step: int) -> Path:
        return self.ckpt_dir / f"step-{step:08d}.safetensors"

    def state(self) -> dict[str, Any]:
        """Everything a resume needs, as a tree for :func:`memlab.ckpt.save`."""
        assert self.optimizer is not None
        return {
            "format": "memlab.train/1",
            "step": self.step,
            "losses": list(self.losses),
            "step_peaks": list(self.step_peaks),
            "stack": dataclasses.asdict(self.stack),
            "stack_index": self.stack_index,
            "stacks": [dataclasses.asdict(s) for s in self.stacks],
            "backoffs": [b.to_json() for b in self.backoffs],
            "data": {"position": self.step, "seed": self.seed, "effective_batch": self.effective_batch,
                     "seq_len": self.seq_len},
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
        }

    def save_checkpoint(self) -> Path:
        """Write the current state atomically and read it back verified; then keep the ``keep``
        checkpoints of the highest steps up to this one (by step number). The one just written is
        never deleted; if it does not verify, nothing older is deleted either; a file of a higher
        step (one this run did not write since it resumed) is never deleted."""
        path = _ckpt.save(self.state(), self._ckpt_path(self.step))
        try:  # read back and verified before any older checkpoint goes
            _ckpt.read_state_json(path)
        except _ckpt.CheckpointError as exc:
            warnings.warn(f"the checkpoint just written does not verify ({exc}); keeping every older one",
                          stacklevel=2)
            return path
        older = [p for p in _ckpt.iter_checkpoints(self.ckpt_dir, _CKPT_GLOB)
                 if p != path and (_ckpt.step_of(p) is not None and _ckpt.step_of(p) <= self.step)]
        for old in older[self.keep - 1:]:
            old.unlink(missing_ok=True)
        return path

    def _set_aside(self, path: Path, suffix: str) -> None:
        """Rename ``path`` to ``<name>.<suffix>`` (out of the checkpoint pattern; never deleted)."""
        target = path.with_name(f"{path.name}.{suffix}")
        n = 1
        while target.exists():
            target, n = path.with_name(f"{path.name}.{suffix}-{n}"), n + 1
        try:
            os.replace(path, target)
        except OSError as exc:
            raise _ckpt.CheckpointError(f"{path}: cannot rename it to {target.name} ({exc.strerror}); move it out "
                                        f"of {self.ckpt_dir} by hand") from None
        self.set_aside.append(target)

    def _latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest checkpoint that verifies; newer ones that fail are renamed ``<name>.corrupt``
        once a verified one is found (so the keep rule never weighs them against new ones)."""
        bad: list[Path] = []
        for path in _ckpt.iter_checkpoints(self.ckpt_dir, _CKPT_GLOB):
            try:
                state = _ckpt.load(path)
            except _ckpt.CheckpointError as exc:
                self.rejected.append((path, str(exc)))
                bad.append(path)
                warnings.warn(f"skipping a checkpoint that failed verification: {exc}", stacklevel=3)
                continue
            if not isinstance(state, dict):
                raise _ckpt.CheckpointError(f"{path}: not a BudgetTrainer checkpoint (its state is a "
                                            f"{type(state).__name__}); use another ckpt_dir, or fresh=True")
            for b in bad:
                self._set_aside(b, "corrupt")
            state["__path__"] = path
            return state
        return None

    def _check_state(self, state: dict[str, Any]) -> None:
        """Refuse a verified checkpoint of another run before anything is loaded from it."""
        where = state.get("__path__")
        fix = "use another ckpt_dir, or fresh=True (--fresh) to set its checkpoints aside"
        if state.get("format") != "memlab.train/1":
            raise _ckpt.CheckpointError(f"{where}: not a BudgetTrainer checkpoint (format={state.get('format')!r}, "
                                        f"expected 'memlab.train/1'); {fix}")
        need = {"step": int, "losses": list, "step_peaks": list, "stack": dict, "backoffs": list, "data": dict,
                "model": dict, "optimizer": dict, "rng": dict}
        for key, typ in need.items():
            if not isinstance(state.get(key), typ) or isinstance(state.get(key), bool):
                raise _ckpt.CheckpointError(f"{where}: malformed BudgetTrainer checkpoint: {key!r} is "
                                            f"{type(state.get(key)).__name__}, expected {typ.__name__}; {fix}")
        data = state["data"]
        got = tuple(data.get(k) for k in ("effective_batch", "seq_len", "seed"))
        if got != (self.effective_batch, self.seq_len, self.seed):
            raise _ckpt.CheckpointError(
                f"{where}: checkpoint of effective_batch={got[0]}, seq_len={got[1]}, seed={got[2]}; this trainer "
                f"has {self.effective_batch}, {self.seq_len}, {self.seed}; {fix}")
        mine = self.model.state_dict()
        theirs = state["model"]
        missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        if missing or extra:
            raise _ckpt.CheckpointError(f"{where}: checkpoint of another model (missing tensors {missing[:3]}, "
                                        f"unexpected {extra[:3]}); {fix}")
        for k, v in mine.items():
            t = theirs[k]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(v.shape):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise _ckpt.CheckpointError(f"{where}: checkpoint of another model shape: {k} is {shape} there, "
                                            f"{tuple(v.shape)} in this model; {fix}")
        if not (0 <= state["step"] == len(state["losses"]) == len(state["step_peaks"])):
            raise _ckpt.CheckpointError(f"{where}: malformed BudgetTrainer checkpoint: step={state['step']} with "
                                        f"{len(state['losses'])} losses; {fix}")

    def _restore(self, state: dict[str, Any], resume: bool) -> None:
        """Load ``state``; on ``resume`` (a new trainer) also its stack and back-off history."""
        self._check_state(state)
        try:
            self._load_state(state, resume)
        except _ckpt.CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise _ckpt.CheckpointError(f"{state.get('__path__')}: malformed BudgetTrainer checkpoint "
                                        f"({type(exc).__name__}: {str(exc)[:200]}); use another ckpt_dir, or "
                                        "fresh=True") from None
        # hyperparameters are this trainer's, applied explicitly (the optimizer state carries the saved ones)
        assert self.optimizer is not None
        for name, now in (("lr", self.lr), ("weight_decay", self.weight_decay)):
            for g in self.optimizer.param_groups:
                if g.get(name) != now:
                    if resume and name not in self.hparams_applied:
                        self.hparams_applied[name] = (float(g.get(name)), now)
                    g[name] = now
        if resume and self.hparams_applied:
            what = ", ".join(f"{k}={new!r} (the checkpoint had {old!r})" for k, (old, new) in self.hparams_applied.items())
            warnings.warn(f"{state.get('__path__')}: resumed with {what}: applied the new value to the optimizer",
                          stacklevel=3)

    def _load_state(self, state: dict[str, Any], resume: bool) -> None:
        if resume:
            saved = Stack(**state["stack"])
            self.stack_index = self.stacks.index(saved) if saved in self.stacks else 0
            self.backoffs = [Backoff.from_json(b) for b in state["backoffs"]]
            self.resumed_from = state.get("__path__")
            self._apply(self.stack)
        self.model.load_state_dict({k: v.to(self.device) for k, v in state["model"].items()})
        assert self.optimizer is not None
        opt_state = state["optimizer"]
        fused = self.stack.optimizer == "adamw-fused"
        for g in opt_state["param_groups"]:
            g["fused"], g["foreach"] = (True, None) if fused else (None, False)
        self.optimizer.load_state_dict(opt_state)
        _set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.losses = [float(x) for x in state["losses"]]
        self.step_peaks = [int(x) for x in state["step_peaks"]]

    # -------------------------------------------------------------- one optimizer step
    def _guard(self):
        if self.budget is not None and self.device.type == "cpu":
            return BudgetTracker(self.model, self.optimizer, budget=self.budget)
        if self.device.type == "cpu":
            return MemoryTracker(self.model, self.optimizer, timeline=False)
        return contextlib.nullcontext()

    def _optimizer_step(self, step: int, stack: Stack) -> torch.Tensor:
        """One optimizer step of ``stack`` on the batch of ``step``; the mean loss (a 0-d tensor)."""
        assert self.optimizer is not None
        from memlab.models import lm_loss

        x_all, y_all = self._batch(step)
        if tuple(x_all.shape) != (self.effective_batch, self.seq_len) or x_all.shape != y_all.shape:
            raise ValueError(f"data({step}) returned x {tuple(x_all.shape)}, y {tuple(y_all.shape)}; expected both "
                             f"({self.effective_batch}, {self.seq_len})")
        x_all, y_all = x_all.to(self.device), y_all.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        mb, k = stack.micro_batch, stack.grad_accum
        total = None
        for j in range(k):
            x, y = x_all[j * mb:(j + 1) * mb], y_all[j * mb:(j + 1) * mb]
            if stack.precision == "bf16-mixed":
                with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                    loss = lm_loss(self.model, x, y)
            else:
                loss = lm_loss(self.model, x, y)
            (loss / k if k > 1 else loss).backward()
            d = loss.detach().float()
            total = d if total is None else total + d
            del loss, x, y
        self.optimizer.step()
        assert total is not None
        return total / k if k > 1 else total

    def _free(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _set_cuda_fraction(self, on: bool) -> None:
        """Limit this process's CUDA caching allocator to ``budget`` bytes (``on``), or lift the limit."""
        if self.budget is None or self.device.type != "cuda":
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, self.budget / total) if on else 1.0, index)

    # -------------------------------------------------------------- the loop
    @property
    def peak_bytes(self) -> int:
        """Largest per-step peak of the committed steps (tracked bytes on CPU; max_memory_allocated on CUDA)."""
        return max(self.step_peaks, default=0)

    def train(self, steps: int) -> list[float]:
        """Train until ``steps`` optimizer steps are done in all (a resumed run does only the rest);
        returns the loss of every step, ``0 .. steps - 1``."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r} is invalid; allowed: an int >= 0")
        if not any(True for _ in _ckpt.iter_checkpoints(self.ckpt_dir, _CKPT_GLOB)):
            self.save_checkpoint()  # the starting point, so that an OOM in the first step can restore it
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, initial=min(self.step, steps), desc="BudgetTrainer", unit="step")
        self._set_cuda_fraction(True)  # lifted again when train() returns or raises
        try:
            while self.step < steps:
                stack = self.stack
                reason = None
                try:
                    if self.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(self.device)
                    with self._guard() as tracker:
                        loss = self._optimizer_step(self.step, stack).item()
                except torch.OutOfMemoryError as exc:
                    reason = str(exc).splitlines()[0][:300]
                    tracker = None
                if reason is not None:
                    self._free()
                    self._back_off(stack, reason)
                    continue
                peak = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                        else tracker.peak_bytes)
                self.losses.append(loss)
                self.step_peaks.append(int(peak))
                self.step += 1
                if bar is not None:
                    bar.update(1)
                if self.step % self.ckpt_interval == 0 or self.step == steps:
                    self.save_checkpoint()
        finally:
            self._set_cuda_fraction(False)
            if bar is not None:
                bar.close()
        return list(self.losses[:steps])

    def _back_off(self, stack: Stack, reason: str) -> None:
        if self.stack_index + 1 >= len(self.stacks):
            raise torch.OutOfMemoryError(
                f"BudgetTrainer: the last stack {stack} does not fit the budget "
                f"{format_bytes(self.budget or 0)} at step {self.step} ({reason}); nothing left to back off to: "
                "add stacks that need less memory, or raise the budget")
        failed_at = self.step
        self.stack_index += 1
        self._apply(self.stack)
        latest = self._latest_checkpoint()
        if latest is None:
            raise RuntimeError(f"BudgetTrainer: no complete checkpoint in {self.ckpt_dir} to restore after the OOM")
        self._restore(latest, resume=False)
        self.backoffs.append(Backoff(failed_at, stack, self.stack, reason, self.step))


def estimate_stack_peak(model_fn: Callable[[], nn.Module], stack: Stack, seq_len: int, *, steps: int = 2,
                        vocab_size: int = 256) -> int:
    """Predict :func:`measure_stack_peak` without running anything for real: the same trainer step,
    traced on fake tensors (``FakeTensorMode``: shapes only, nothing allocated) and counted by
    :class:`~memlab.profiler.MemoryTracker`. The lab's predict-then-measure reference."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _positive_int("steps", steps)
    with FakeTensorMode():
        model = model_fn()
        E = stack.effective_batch

        def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.randint(0, vocab_size, (E, seq_len)), torch.randint(0, vocab_size, (E, seq_len)))

        t = BudgetTrainer.__new__(BudgetTrainer)
        t.model, t.device, t.lr, t.weight_decay = model.train(), torch.device("cpu"), 1e-3, 0.0
        t.effective_batch, t.seq_len, t._batch = E, seq_len, data
        t.optimizer, t._applied = None, None
        t._apply(stack)
        peak = 0
        for step in range(steps):
            with MemoryTracker(model, t.optimizer, timeline=False) as tracker:
                t._optimizer_step(step, stack)
            peak = max(peak, tracker.peak_bytes)
    return peak


def cheapest_stack(effective_batch: int, budget: int, estimate: Callable[[Stack], float],
                   cost: Callable[[Stack], float]) -> Stack | None:
    """The planner of chapter 07's lab over a small search space.

    Candidates: ``Stack(micro_batch=m, grad_accum=effective_batch // m, checkpointing=c)`` for every
    divisor ``m`` of ``effective_batch``, largest first, and ``c`` in ``("none", "full")``. A
    candidate fits when ``estimate(stack) <= budget``. Among those that fit: the smallest
    ``cost(stack)``; ties go to the smaller estimate, then to the earlier candidate. ``None``
    when nothing fits. (:func:`memlab.plan.plan` is the full planner.)
    """
    _positive_int("effective_batch", effective_batch)
    best: tuple[float, float, int] | None = None
    pick = None
    i = 0
    for m in sorted((d for d in range(1, effective_batch + 1) if effective_batch % d == 0), reverse=True):
        for c in ("none", "full"):
            s = Stack(micro_batch=m, grad_accum=effective_batch // m, checkpointing=c)
            peak = estimate(s)
            if peak <= budget:
                key = (cost(s), peak, i)
                if best is None or key < best:
                    best, pick = key, s
            i += 1
    return pick


def measure_stack_peak(model_fn: Callable[[], nn.Module], stack: Stack, seq_len: int, *, steps: int = 2,
                       seed: int = 0, data: Any = None) -> int:
    """Tracked peak bytes of ``steps`` optimizer steps of ``model_fn()`` run with ``stack``, no budget
    (the measurement a prediction of the stack's peak is graded against; CPU)."""
    torch.manual_seed(seed)
    model = model_fn()
    t = BudgetTrainer(model, None, stacks=[stack], data=data, effective_batch=stack.effective_batch,
                      seq_len=seq_len, seed=seed, ckpt_interval=10**9)
    t.train(steps)
    return t.peak_bytes


# ----------------------------------------------------------------------------- length bucketing
def _check_lengths(lengths: Any) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    try:
        out = [int(n) for n in lengths]
    except (TypeError, ValueError):
        raise ValueError(f"lengths={str(lengths)[:60]!r} is invalid; allowed: a sequence of ints >= 1") from None
    bad = [n for n in out if n < 1]
    if bad or not out:
        raise ValueError(f"lengths: {'empty' if not out else f'length {bad[0]}'} is invalid; allowed: a non-empty "
                         "sequence of ints >= 1")
    return out


def random_batches(lengths: Sequence[int], batch_size: int, *, seed: int = 0) -> list[list[int]]:
    """Indices shuffled under ``seed`` and cut into batches of ``batch_size`` (the last may be short)."""
    n = len(_check_lengths(lengths))
    _positive_int("batch_size", batch_size)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def bucket_batches(lengths: Sequence[int], batch_size: int, *, pool: int | None = None, seed: int = 0,
                   shuffle: bool = True) -> list[list[int]]:
    """Batches of indices whose sequences have similar lengths, so that padding to the longest wastes little.

    Shuffle the indices (``seed``), take pools of ``pool`` batches (``None``: the whole data set),
    sort each pool by length (stable) and cut it into batches of ``batch_size``; then shuffle the
    order of the batches, so that training does not see lengths in order. Smaller pools keep more
    randomness and save less padding. Every index appears exactly once.
    """
    lens = _check_lengths(lengths)
    _positive_int("batch_size", batch_size)
    if pool is not None:
        _positive_int("pool", pool)
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
    size = n if pool is None else pool * batch_size
    out: list[list[int]] = []
    for start in range(0, n, size):
        chunk = sorted(order[start:start + size], key=lambda i: lens[i])
        out += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    if shuffle:
        out = [out[i] for i in torch.randperm(len(out), generator=g).tolist()]
    return out


def padding_stats(lengths: Sequence[int], batches: Sequence[Sequence[int]], *, bytes_per_token: int = 1) -> dict[str, Any]:
    """Tokens, padded slots and padding bytes when each batch is padded to its longest sequence.

    ``bytes_per_token``: the bytes one token position costs in whatever you pad (1 for the ids
    counted as tokens; the activation bytes per token of a model for its activations).
    """
    lens = _check_lengths(lengths)
    seen: list[int] = [i for b in batches for i in b]
    if sorted(seen) != list(range(len(lens))):
        raise ValueError("batches: every index 0..len(lengths)-1 must appear exactly once")
    tokens = sum(lens)
    slots = sum(len(b) * max(lens[i] for i in b) for b in batches if len(b))
    return {"tokens": tokens, "slots": slots, "padding": slots - tokens, "padding_fraction": (slots - tokens) / slots,
            "padding_bytes": (slots - tokens) * bytes_per_token}


def pad_batch(seqs: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D token tensors to the longest: ``(ids (B, T), mask (B, T) bool)``."""
    if not seqs:
        raise ValueError("seqs: empty; allowed: a non-empty sequence of 1-D tensors")
    T = max(int(s.numel()) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :s.numel()] = s.reshape(-1)
        mask[i, :s.numel()] = True
    return ids, mask
