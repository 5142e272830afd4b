"""Train under a memory budget: back off on OOM, resume from a checkpoint, lose nothing (chapter 07).

:class:`BudgetTrainer` runs a list of training stacks (:class:`memlab.plan.Stack`, most
memory-hungry first, as a planner ranks them) on a real model and real data, and keeps the run
inside ``budget`` bytes:

* **the budget is enforced, not hoped for**, on one quantity on both devices: the bytes of the
  training's own tensors -- parameters, buffers, gradients, optimizer state, activations, the batch
  -- at a step's peak. On the CPU :class:`BudgetTracker` (a :class:`memlab.profiler.MemoryTracker`
  that sees every storage an op creates) raises ``torch.OutOfMemoryError`` as soon as they would
  exceed ``budget``; a refused total never counts toward the peak. On CUDA the caching allocator's
  own counter measures them: ``torch.cuda.max_memory_allocated`` during the step, less what was
  allocated on the device before the step and is not the trainer's (other tensors of the process;
  the cuBLAS/cuBLASLt workspaces, 32 MiB per matmul thread on Hopper -- forward and autograd --,
  which ``train()`` creates before its first step with a tiny matmul so that no step is charged
  them; the CUDA context is outside the allocator anyway). A step whose peak so counted exceeds
  ``budget`` is an OOM like a refused allocation: it is not committed, and the trainer backs off.
  The allocator also refuses for real, as a backstop that stops a runaway step early:
  ``torch.cuda.set_per_process_memory_fraction`` caps the reserved bytes, while ``train()`` runs,
  at those reserved when it starts (after ``empty_cache``) + ``budget`` + 20 MiB (one segment of
  the allocator's rounding). The cap alone cannot be the budget: it limits reserved bytes of the
  whole process and only new ``cudaMalloc``s, so cached blocks of earlier work can serve a step past
  it unrefused (an H200, 2026-11-28: a "peak" of 108,147,712 B under a 64 MiB budget, no back-off; the
  two cuBLAS workspaces alone are 64 MiB there, results/h100/diag.log).
* **on OOM it backs off**: frees what the failed step held, moves to the next stack (a smaller
  micro-batch with more gradient accumulation, the same effective batch; then checkpointing), and
  restores the last checkpoint (model, optimizer state, RNG states, data position, loss history),
  so the failed step is re-run from a state that is bitwise the one before it. Each back-off is a
  :class:`Backoff` event in ``.backoffs``.
* **it checkpoints with** :mod:`memlab.train.state` (one safetensors file, atomic rename, SHA-256
  verified) every ``ckpt_interval`` optimizer steps; a new ``BudgetTrainer`` on the same
  ``ckpt_dir`` resumes from the newest complete checkpoint, after a crash or ``kill -9`` at any
  instant, with nothing lost or repeated. Checkpoints are written between optimizer steps,
  outside the budgeted step (from host memory: on a GPU the state is copied to the host).

The one formula: with ``k`` equal micro-batches and mean losses, the accumulated gradient
``g = (1/k) * sum_j grad L(micro-batch j)`` is the gradient of the mean loss of the whole effective
batch, so ``micro_batch * grad_accum`` is all that training sees (gradient accumulation). The
stacks' other knobs are those of chapters 02-06 (checkpointing: Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost", arXiv:1604.06174).

Resuming is exact: the data is addressed by position (optimizer step ``i`` always draws the same
windows, whatever the micro-batch), and a restored state is bitwise the one that was saved; a
micro-batch change in mid-run moves the losses by floating-point rounding only (the order of the
gradient additions changes).

Stacks this trainer runs (other values are errors that say so): precision ``fp32`` or
``bf16-mixed`` (autocast; ``"bf16"`` is its alias, as everywhere in memlab); checkpointing
``none``, ``every-k`` or ``full`` (each chosen block's forward is recomputed in backward, torch's
non-reentrant ``checkpoint``); optimizer ``adamw`` or ``adamw-fused``; adapter ``full``; attention
``eager`` or ``sdpa`` (applied to TinyGPT and to ``transformers`` models); and chapter 09's knobs on a
``transformers`` causal LM: loss ``default`` (:func:`memlab.models.lm_loss`: the logits made whole),
``chunked`` (:func:`memlab.loss.chunked_cross_entropy` of the decoder's last hidden states and the head's
weight) or ``fused`` (:func:`memlab.loss.enable`: the logits never materialised), each the mean cross-entropy
of the same targets; the optimizer step in backward (``optimizer_in_backward=True``:
:func:`memlab.offload.optimizer_in_backward`, one AdamW per parameter stepped by its post-accumulate-grad
hook, the gradient freed at once; the same update, so a run's losses do not change). Checkpoints hold the
optimizer state in one format (a whole-model AdamW ``state_dict``) whichever way the step runs, so a
back-off may switch it on or off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from memlab.train import state as training_state
from memlab.core.units import MiB, format_bytes
from memlab.models import decoder_layers
from memlab.offload.in_backward import OptimizerInBackward, optimizer_in_backward
from memlab.plan import Stack
from memlab.profiler import MemoryTracker
from memlab.train.arguments import check_arguments, check_batch, check_corpus, check_steps, vocab_size
from memlab.train.budget import BudgetTracker
from memlab.train.lock import DirectoryLock
from memlab.train.resume import FORMAT, ForeignCheckpointError, check_trainer_state, model_config
from memlab.train.stacks import SUPPORTED, Backoff, back_off_chain

__all__ = ["BudgetTrainer"]

_CKPT_GLOB = "step-*.safetensors"


def _set_attention(model: nn.Module, attention: str) -> None:
    # "eager" or "sdpa": TinyGPT's blocks, or a transformers model's setter (its config on older versions)
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
    # data(step) -> (x, y): effective_batch windows of the corpus' train split, a pure function of step
    from memlab.models.corpus import split_bounds

    lo, hi = split_bounds(corpus.numel(), "train")  # memlab.train.arguments checked its shape and length
    train = corpus[lo:hi]
    window = torch.arange(seq_len + 1)
    n_starts = train.numel() - seq_len

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, n_starts, (effective_batch,), generator=g)
        chunk = train[starts[:, None] + window].long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    return batch


# the caching allocator's segment for a 1-10 MiB request (kLargeBuffer): the backstop cap's slack
_SEGMENT_SLACK = 20 * MiB


def _warm_up_cuda_matmuls(device: torch.device, precisions: set[str]) -> None:
    # cuBLAS (and cuBLASLt, for bf16 addmm) keep a workspace for each thread that runs matmuls, allocated through
    # the caching allocator by the thread's first matmul and kept for the process: 32 MiB each on Hopper, for the
    # forward thread and the autograd engine's (results/h100/diag.log). One tiny linear + matmul, forward and
    # backward, in each precision the stacks run, makes them now, outside every measured step (no RNG is used).
    for precision in sorted(precisions):
        w = torch.ones(16, 16, device=device, requires_grad=True)
        b = torch.zeros(16, device=device, requires_grad=True)
        x = torch.ones(4, 16, device=device, requires_grad=True)
        amp = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if precision == "bf16-mixed"
               else contextlib.nullcontext())
        with amp:
            y = torch.nn.functional.linear(x, w, b) @ w
        y.float().sum().backward()
        del w, b, x, y


class BudgetTrainer:
    """Train ``model`` inside ``budget`` bytes, backing off along ``stacks`` on OOM (see the module doc).

    Args:
        model: an ``nn.Module`` whose loss :func:`memlab.models.lm_loss` computes (TinyGPT, any
            ``transformers`` causal LM), or ``None`` for a small :class:`memlab.models.TinyGPT`
            built under ``torch.manual_seed(seed)``.
        budget: bytes (an int, or a string such as ``"24 MiB"``); ``None`` measures without a limit.
        stacks: the stacks to try, in order (all with ``effective_batch``); after an OOM the next
            one is used. A single :class:`~memlab.plan.Stack` means ``back_off_chain(stack)``.
        data: ``None`` (the standard-library corpus, :func:`memlab.models.corpus.stdlib_corpus`), a 1-D
            tensor of token ids (windows are drawn from its first 90%), or ``data(step) -> (x, y)``
            returning ``(effective_batch, seq_len)`` long tensors, a pure function of ``step``.
        effective_batch, seq_len: sequences per optimizer step and tokens per sequence.
        ckpt_dir: where checkpoints go (a temporary directory when ``None``); the newest complete
            checkpoint there is resumed, with its stack and back-off history when that stack is
            in ``stacks`` (else from ``stacks[0]``). The directory belongs to one trainer at a
            time (:mod:`memlab.train.lock`: a lock file with the owner's pid; another live trainer there
            is refused with :class:`~memlab.train.lock.DirectoryInUseError`, the lock of a dead one taken
            over, a newer trainer object of this process supersedes an idle older one; :meth:`close`
            gives it up): leftover temp files of a killed writer are removed when a trainer opens it.
        seed: seeds the default model, the data order and the RNGs at the start.
        lr, weight_decay: AdamW's.
        ckpt_interval: optimizer steps between checkpoints (also one at the start and at the end).
        keep: how many complete checkpoints to keep (>= 2, so a corrupted newest one has a fallback),
            counted by step number among the verified ones; the newest verified one is never deleted.
        progress: show a tqdm bar over the optimizer steps.
        fresh: start at step 0 even though ``ckpt_dir`` holds checkpoints: they are renamed to
            ``<name>.set-aside`` (never deleted). Without it, a directory whose checkpoints all
            fail verification is refused (:class:`memlab.train.state.CheckpointError`), so that a
            corruption never silently restarts a run from step 0.

    Every argument is checked before any work (:mod:`memlab.train.arguments`: types, finiteness,
    ranges, in memlab's one error format), and the data against the model's vocabulary: a corpus whole
    at the start, a data function's batch at the start and each one as it is drawn (a token id the
    model cannot embed is named by step, row and position, not an ``IndexError``).

    Checkpoints that fail verification, or whose state is malformed (:mod:`memlab.train.resume`
    checks every field before anything is loaded), are skipped (newest first) and renamed to
    ``<name>.corrupt``: the newest valid one is resumed. One that is valid but belongs to another run
    (another model's config -- stored in each checkpoint, so a 4-head model is told from a 2-head one
    of the same shapes --, its tensors, another ``effective_batch``/``seq_len``/``seed``, not a
    trainer's state) raises :class:`~memlab.train.resume.ForeignCheckpointError` (a
    :class:`~memlab.train.state.CheckpointError`) in one line naming the file and the difference.
    Resuming with another ``lr`` or ``weight_decay`` than the checkpoint's applies the new value to the
    optimizer and warns (``hparams_applied`` lists what changed).
    """

    def __init__(self, model: nn.Module | None = None, budget: int | str | None = None, *,
                 stacks: Sequence[Stack] | Stack, data: Any = None, effective_batch: int, seq_len: int,
                 ckpt_dir: str | Path | None = None, seed: int = 0, lr: float = 1e-3, weight_decay: float = 0.0,
                 ckpt_interval: int = 1, keep: int = 2, progress: bool = False, fresh: bool = False) -> None:
        args = check_arguments(model=model, budget=budget, data=data, effective_batch=effective_batch,
                               seq_len=seq_len, ckpt_dir=ckpt_dir, seed=seed, lr=lr, weight_decay=weight_decay,
                               ckpt_interval=ckpt_interval, keep=keep, progress=progress, fresh=fresh)
        self.effective_batch, self.seq_len, self.seed = args["effective_batch"], args["seq_len"], args["seed"]
        self.ckpt_interval, self.keep, self.progress = args["ckpt_interval"], args["keep"], args["progress"]
        self.lr, self.weight_decay, self.budget = args["lr"], args["weight_decay"], args["budget"]
        self.stacks = self._check_stacks(stacks)
        self._check_model_runs(model, self.stacks)  # every argument is checked before any work below

        from memlab.config import seed_everything

        seed_everything(self.seed)
        if model is None:
            from memlab.models import TinyGPT, TinyGPTConfig

            model = TinyGPT(TinyGPTConfig(block_size=max(self.seq_len, 64), n_layer=2, n_head=2, n_embd=64))
        self.model = model
        self.model.train()
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self._vocab = vocab_size(self.model)
        self._batch = self._make_data(data)

        self._tmp = None
        if args["ckpt_dir"] is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="memlab-ckpt-")
        self.ckpt_dir = Path(self._tmp.name) if self._tmp is not None else args["ckpt_dir"]
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        # the directory is this trainer's alone (memlab.train.lock): another live trainer there is refused
        self._lock = DirectoryLock(self.ckpt_dir).acquire()
        try:
            self._open(fresh)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, fresh: bool) -> None:
        # Take over the directory: remove a killed writer's temp files, resume the newest valid checkpoint.
        self.stale_temps_removed = training_state.remove_stale_temps(self.ckpt_dir)
        self.step = 0
        self.losses: list[float] = []
        self.backoffs: list[Backoff] = []
        self.step_peaks: list[int] = []  # each committed step's peak_bytes (see there)
        self.stack_index = 0
        self.resumed_from: Path | None = None
        self.rejected: list[tuple[Path, str]] = []  # checkpoints that failed verification
        self.set_aside: list[Path] = []  # checkpoints renamed out of the way (corrupt, or fresh=True)
        self.hparams_applied: dict[str, tuple[float, float]] = {}  # name: (checkpoint's, now)
        self._applied: Stack | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._apply(self.stacks[0])
        if fresh:
            for path in list(training_state.iter_checkpoints(self.ckpt_dir, _CKPT_GLOB)):
                self._set_aside(path, "set-aside")
        latest = self._latest_checkpoint()
        if latest is not None:
            self._restore(latest, resume=True)
        elif self.rejected:
            lines = "; ".join(f"{p.name}: {why.split(': ', 1)[-1]}" for p, why in self.rejected[:5])
            raise training_state.CheckpointError(
                f"ckpt_dir={str(self.ckpt_dir)!r}: no checkpoint there verifies ({len(self.rejected)} rejected: "
                f"{lines}); refusing to restart from step 0 over them. Restore a good copy, or pass fresh=True "
                "(--fresh) to set them aside and start from step 0")
        if self._data_fn:  # a data function: its first batch now, each later one as it is drawn
            x, y = self._batch(self.step)
            check_batch(self.step, x, y, (self.effective_batch, self.seq_len), self._vocab)

    def close(self) -> None:
        """Give the checkpoint directory up (its lock), so that another trainer may open it; also done when
        the trainer is garbage collected or the process exits."""
        self._lock.release()

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
        out = self._check_stacks_type(stacks)  # Stack stores canonical spellings (bf16 -> bf16-mixed)
        for i, s in enumerate(out):
            if s.effective_batch != self.effective_batch:
                raise ValueError(f"stacks[{i}]: micro_batch={s.micro_batch} x grad_accum={s.grad_accum} = "
                                 f"{s.effective_batch}; allowed: effective_batch={self.effective_batch}")
            for knob, allowed in SUPPORTED.items():
                if getattr(s, knob) not in allowed:
                    raise ValueError(f"stacks[{i}].{knob}={getattr(s, knob)!r}: BudgetTrainer runs "
                                     f"{', '.join(map(repr, allowed))}")
        return out

    @staticmethod
    def _check_model_runs(model: nn.Module | None, stacks: Sequence[Stack]) -> None:
        # chapter 09's losses replace a transformers causal LM's head + loss (memlab.loss): refuse other models
        for i, s in enumerate(stacks):
            if s.loss == "default":
                continue
            if model is None:
                raise ValueError(f"stacks[{i}].loss={s.loss!r} needs a transformers causal LM; the default model is a "
                                 "TinyGPT; allowed for it: loss='default'")
            if s.loss == "fused":
                from memlab.loss.hf import causal_lm_head

                try:
                    causal_lm_head(model)
                except ValueError as exc:
                    raise ValueError(f"stacks[{i}].loss='fused' needs a transformers *ForCausalLM memlab.loss.enable "
                                     f"supports ({exc}); allowed for this model: loss='default'") from None
            elif not (callable(getattr(model, "get_decoder", None))
                      and callable(getattr(model, "get_output_embeddings", None))):
                raise ValueError(f"stacks[{i}].loss={s.loss!r} needs a transformers causal LM (get_decoder, "
                                 f"get_output_embeddings); {type(model).__name__} is not one; allowed for this model: "
                                 f"loss='default'")

    def _make_data(self, data: Any) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        if data is None:
            from memlab.config import pick
            from memlab.models.corpus import stdlib_corpus

            data = stdlib_corpus(max_bytes=pick(full=None, small=MiB))
        self._data_fn = not isinstance(data, torch.Tensor)  # check_arguments allowed a tensor or a function
        if self._data_fn:
            return data
        from memlab.models.corpus import split_bounds

        lo, hi = split_bounds(data.numel(), "train")
        check_corpus(data[lo:hi], self._vocab, offset=lo)  # the windows are drawn from the train split only
        return _corpus_data(data, self.seq_len, self.effective_batch, self.seed)

    # -------------------------------------------------------------- stacks
    @property
    def stack(self) -> Stack:
        """The stack in use now."""
        return self.stacks[self.stack_index]

    def _apply(self, stack: Stack) -> None:
        # Make the model and the optimizer run ``stack`` (checkpointing, attention, optimizer kind).
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
        if old is None or old.loss != stack.loss:
            from memlab.loss import disable, enable

            disable(self.model)  # a model memlab.loss.enable never touched is left as it is
            if stack.loss == "fused":
                enable(self.model)
        if self.optimizer is None or old is None or (old.optimizer, old.optimizer_in_backward) != \
                (stack.optimizer, stack.optimizer_in_backward):
            sd = self._optimizer_state() if self.optimizer is not None else None
            if isinstance(self.optimizer, OptimizerInBackward):
                self.optimizer.remove()  # its hooks would step the parameters in every later backward
            params = [p for p in self.model.parameters() if p.requires_grad]
            fused = stack.optimizer == "adamw-fused"
            kw = {"fused": True} if fused else {"foreach": False}

            def make(ps: list) -> torch.optim.Optimizer:
                return torch.optim.AdamW(ps, lr=self.lr, weight_decay=self.weight_decay, **kw)

            self.optimizer = optimizer_in_backward(params, make) if stack.optimizer_in_backward else make(params)
            self._applied = stack
            if sd is not None:
                self._load_optimizer_state(sd)
        self._applied = stack

    # -------------------------------------------------------------- the optimizer state, one format
    def _optimizer_state(self) -> dict[str, Any]:
        # A whole-model AdamW state_dict (parameters numbered in model.parameters() order), whichever way the
        # step runs: one optimizer, or one per parameter in backward.
        opt = self.optimizer
        assert opt is not None
        if not isinstance(opt, OptimizerInBackward):
            return opt.state_dict()
        params = list(opt.optimizers)
        state, group = {}, None
        for i, p in enumerate(params):
            sd = opt.optimizers[p].state_dict()
            if sd["state"]:
                state[i] = sd["state"][0]
            group = sd["param_groups"][0]
        assert group is not None
        return {"state": state, "param_groups": [dict(group, params=list(range(len(params))))]}

    def _load_optimizer_state(self, sd: dict[str, Any]) -> None:
        # Load a state _optimizer_state wrote into the optimizer of the current stack (with its fused flag).
        opt = self.optimizer
        assert opt is not None
        fused = self._applied is not None and self._applied.optimizer == "adamw-fused"
        groups = [dict(g, **({"fused": True, "foreach": None} if fused else {"fused": None, "foreach": False}))
                  for g in sd["param_groups"]]
        if not isinstance(opt, OptimizerInBackward):
            opt.load_state_dict({"state": sd["state"], "param_groups": groups})
            return
        if len(groups) != 1 or len(groups[0]["params"]) != len(opt.optimizers):
            raise ValueError(f"optimizer state of {sum(len(g['params']) for g in groups)} parameters in "
                             f"{len(groups)} groups; the step in backward needs one group of {len(opt.optimizers)}")
        for i, p in enumerate(opt.optimizers):
            one = {"state": {0: sd["state"][i]} if i in sd["state"] else {},
                   "param_groups": [dict(groups[0], params=[0])]}
            opt.optimizers[p].load_state_dict(one)
        opt.param_groups = [g for o in opt.optimizers.values() for g in o.param_groups]

    # -------------------------------------------------------------- checkpoints
    def _ckpt_path(self, step: int) -> Path:
        return self.ckpt_dir / f"step-{step:08d}.safetensors"

    def state(self) -> dict[str, Any]:
        """Everything a resume needs, a tree for :func:`memlab.train.state.save`: model, optimizer,
        RNG states, step, losses, stacks and back-offs."""
        assert self.optimizer is not None
        return {
            "format": FORMAT,
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
            "model_config": model_config(self.model),  # tells a 4-head model from a 2-head one of the same shapes
            "optimizer": self._optimizer_state(),
            "rng": training_state.rng_state(),
        }

    def save_checkpoint(self) -> Path:
        """Write the current state atomically and read it back verified; then keep the ``keep``
        checkpoints of the highest steps up to this one (by step number). The one just written is
        never deleted; if it does not verify, nothing older is deleted either; a file of a higher
        step (one this run did not write since it resumed) is never deleted. Returns the path written.

        Raises:
            memlab.train.lock.DirectoryInUseError: a newer trainer of this process took ``ckpt_dir`` over.
        """
        with self._lock.busy():
            return self._save_checkpoint()

    def _save_checkpoint(self) -> Path:
        path = training_state.save(self.state(), self._ckpt_path(self.step))
        try:  # read back and verified before any older checkpoint goes
            training_state.read_state_json(path)
        except training_state.CheckpointError as exc:
            warnings.warn(f"the checkpoint just written does not verify ({exc}); keeping every older one",
                          stacklevel=2)
            return path
        older = [p for p in training_state.iter_checkpoints(self.ckpt_dir, _CKPT_GLOB)
                 if p != path and (training_state.step_of(p) is not None and training_state.step_of(p) <= self.step)]
        for old in older[self.keep - 1:]:
            old.unlink(missing_ok=True)
        return path

    def _set_aside(self, path: Path, suffix: str) -> None:
        # Rename ``path`` to ``<name>.<suffix>`` (out of the checkpoint pattern; never deleted).
        target = path.with_name(f"{path.name}.{suffix}")
        n = 1
        while target.exists():
            target, n = path.with_name(f"{path.name}.{suffix}-{n}"), n + 1
        try:
            os.replace(path, target)
        except OSError as exc:
            raise training_state.CheckpointError(f"{path}: cannot rename it to {target.name} ({exc.strerror}); move it out "
                                        f"of {self.ckpt_dir} by hand") from None
        self.set_aside.append(target)

    def _latest_checkpoint(self) -> dict[str, Any] | None:
        # The newest checkpoint that verifies and holds a well-formed state of this run (memlab.train.resume);
        # newer ones that fail are renamed ``<name>.corrupt`` once a good one is found (so the keep rule never
        # weighs them against new ones). A valid checkpoint of another run or model is refused, not skipped.
        bad: list[Path] = []
        for path in training_state.iter_checkpoints(self.ckpt_dir, _CKPT_GLOB):
            try:
                state = training_state.load(path)
                check_trainer_state(state, model=self.model, effective_batch=self.effective_batch,
                                    seq_len=self.seq_len, seed=self.seed, where=path)
            except ForeignCheckpointError:
                raise
            except training_state.CheckpointError as exc:
                self.rejected.append((path, str(exc)))
                bad.append(path)
                warnings.warn(f"skipping a checkpoint that failed verification: {exc}", stacklevel=3)
                continue
            for b in bad:
                self._set_aside(b, "corrupt")
            state["__path__"] = path
            return state
        return None

    def _restore(self, state: dict[str, Any], resume: bool) -> None:
        # Load ``state`` (checked by _latest_checkpoint); on ``resume`` (a new trainer) also its stack and
        # back-off history.
        try:
            self._load_state(state, resume)
        except training_state.CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise training_state.CheckpointError(f"{state.get('__path__')}: malformed BudgetTrainer checkpoint "
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
            saved = Stack(**state["stack"])  # the trainer stores only stacks it runs (SUPPORTED)
            self.stack_index = self.stacks.index(saved) if saved in self.stacks else 0
            self.backoffs = [Backoff.from_json(b) for b in state["backoffs"]]
            self.resumed_from = state.get("__path__")
            self._apply(self.stack)
        self.model.load_state_dict({k: v.to(self.device) for k, v in state["model"].items()})
        assert self.optimizer is not None
        self._load_optimizer_state(state["optimizer"])
        training_state.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.losses = [float(x) for x in state["losses"]]
        self.step_peaks = [int(x) for x in state["step_peaks"]]

    # -------------------------------------------------------------- one optimizer step
    @property
    def _cuda_counts(self) -> bool:
        # whether a step is measured by the CUDA caching allocator's counters (else by a tracker, on the CPU)
        return self.device.type == "cuda"

    def _guard(self):
        if self._cuda_counts:
            return contextlib.nullcontext()
        if self.budget is not None:
            return BudgetTracker(self.model, self.optimizer, budget=self.budget)
        return MemoryTracker(self.model, self.optimizer, timeline=False)

    def _cuda_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _own_storages(self) -> dict[int, int]:
        # data pointer -> bytes of each storage the trainer holds between steps on its device: parameters,
        # buffers, their gradients, the optimizer state (what the CPU tracker charges when a step starts)
        from memlab.profiler.storage import optimizer_tensors

        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.optimizer is not None:
            tensors += optimizer_tensors(self.optimizer)
        out: dict[int, int] = {}
        for t in tensors:
            if t.device == self.device or (t.device.type == self.device.type and self.device.index is None):
                st = t.untyped_storage()
                if st.nbytes():
                    out[st.data_ptr()] = st.nbytes()
        return out

    def _allocated_outside(self) -> int:
        """Bytes the CUDA caching allocator holds allocated now that are not the trainer's: every allocated
        block (``torch.cuda.memory_allocated``) less the blocks of the trainer's own storages, read from the
        allocator's snapshot (their sizes as the allocator counts them, rounding included)."""
        index = self._cuda_index()
        own = self._own_storages()
        mine = 0
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", index) != index:
                continue
            for block in seg.get("blocks", ()):
                if block.get("state") == "active_allocated" and block.get("address") in own:
                    mine += int(block["size"])
        return max(0, int(torch.cuda.memory_allocated(index)) - mine)

    def _optimizer_step(self, step: int, stack: Stack) -> torch.Tensor:
        # One optimizer step of ``stack`` on the batch of ``step``; the mean loss (a 0-d tensor).
        assert self.optimizer is not None
        x_all, y_all = self._batch(step)
        # a data function's ids against the vocabulary (a corpus was checked whole when the trainer started)
        vocab = getattr(self, "_vocab", None) if getattr(self, "_data_fn", False) else None
        check_batch(step, x_all, y_all, (self.effective_batch, self.seq_len), vocab)
        x_all, y_all = x_all.to(self.device), y_all.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        mb, k = stack.micro_batch, stack.grad_accum
        total = None
        for j in range(k):
            x, y = x_all[j * mb:(j + 1) * mb], y_all[j * mb:(j + 1) * mb]
            if stack.precision == "bf16-mixed":
                with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                    loss = self._loss(stack, x, y)
            else:
                loss = self._loss(stack, x, y)
            (loss / k if k > 1 else loss).backward()
            d = loss.detach().float()
            total = d if total is None else total + d
            del loss, x, y
        self.optimizer.step()
        assert total is not None
        return total / k if k > 1 else total

    def run_step(self, step: int, stack: Stack | None = None) -> torch.Tensor:
        """One optimizer step of ``stack`` (default: the stack in use; another one is applied to the model
        first) on the batch of optimizer step ``step``, outside the budget and the checkpoints: what
        :meth:`train` runs inside its guard, for measuring it (e.g. under
        :func:`memlab.profiler.peak_beside_allocator`). It updates the model; ``step``, ``losses`` and the
        checkpoints are left as they are. Returns the mean loss (a 0-d tensor).

        Raises:
            ValueError: ``step`` < 0, or a ``stack`` this trainer cannot run.
        """
        check_steps("step", step)
        if stack is None:
            return self._optimizer_step(step, self.stack)
        self._check_stacks([stack])
        self._check_model_runs(self.model, [stack])
        self._apply(stack)
        try:
            return self._optimizer_step(step, stack)
        finally:
            self._apply(self.stack)  # train() goes on with its own stack

    def _loss(self, stack: Stack, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The mean cross-entropy of the targets y (every position), by the stack's loss.
        from memlab.models import lm_loss

        if stack.loss == "fused":  # memlab.loss.enable'd in _apply: the targets given as they are (no shift)
            return self.model(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss
        if stack.loss == "chunked":
            from memlab.loss import chunked_cross_entropy

            hidden = self.model.get_decoder()(input_ids=x, use_cache=False).last_hidden_state
            head = self.model.get_output_embeddings()
            return chunked_cross_entropy(hidden, head.weight, y, bias=getattr(head, "bias", None))
        return lm_loss(self.model, x, y)

    def _free(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self._cuda_counts:
            torch.cuda.empty_cache()

    def _set_cuda_fraction(self, on: bool) -> None:
        # The allocator's backstop (``on``), or lift it: cap the process's reserved bytes at those reserved now
        # (cached free blocks released first: they would serve a step unrefused) + budget + one segment's slack.
        # The budget itself is checked on the allocator's counter after each step (_train).
        if self.budget is None or not self._cuda_counts:
            return
        index = self._cuda_index()
        total = torch.cuda.get_device_properties(index).total_memory
        if not on:
            torch.cuda.set_per_process_memory_fraction(1.0, index)
            return
        torch.cuda.empty_cache()
        cap = torch.cuda.memory_reserved(index) + self.budget + _SEGMENT_SLACK
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)

    # -------------------------------------------------------------- the loop
    @property
    def peak_bytes(self) -> int:
        """Largest per-step peak of the committed steps, in bytes: the trainer's own tensors (parameters,
        buffers, gradients, optimizer state, activations, the batch) at the step's peak, on both devices.
        On the CPU the tracker's count; on CUDA the caching allocator's own (``max_memory_allocated`` during
        the step, less the bytes allocated when it started that are not the trainer's: other tensors of the
        process, the cuBLAS workspaces; kernel scratch that no op returns is in it, block rounding too)."""
        return max(self.step_peaks, default=0)

    def train(self, steps: int) -> list[float]:
        """Train until ``steps`` (>= 0) optimizer steps are done in all (a resumed run does only the
        rest), backing off along the stacks on OOM; return the loss of every step, ``0 .. steps - 1``.

        Raises:
            torch.OutOfMemoryError: a step does not fit even the last stack.
            memlab.train.lock.DirectoryInUseError: a newer trainer of this process took ``ckpt_dir`` over.
        """
        check_steps("steps", steps)
        with self._lock.busy():  # no other trainer object of this process takes the directory meanwhile
            return self._train(steps)

    def _train(self, steps: int) -> list[float]:
        if not any(True for _ in training_state.iter_checkpoints(self.ckpt_dir, _CKPT_GLOB)):
            self.save_checkpoint()  # the starting point, so that an OOM in the first step can restore it
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, initial=min(self.step, steps), desc="BudgetTrainer", unit="step")
        cuda = self._cuda_counts
        if cuda:  # the matmul libraries' workspaces made now, outside every step
            _warm_up_cuda_matmuls(self.device, {s.precision for s in self.stacks})
        self._set_cuda_fraction(True)  # lifted again when train() returns or raises
        try:
            while self.step < steps:
                stack = self.stack
                reason = None
                outside = 0
                try:
                    if cuda:  # the allocator counts the whole process: what is not the trainer's is set apart
                        outside = self._allocated_outside()
                        torch.cuda.reset_peak_memory_stats(self._cuda_index())
                    with self._guard() as tracker:
                        loss = self._optimizer_step(self.step, stack).item()
                except torch.OutOfMemoryError as exc:
                    reason = str(exc).splitlines()[0][:300]
                    tracker = None
                if reason is None and cuda:
                    peak = int(torch.cuda.max_memory_allocated(self._cuda_index())) - outside
                    if self.budget is not None and peak > self.budget:  # the step ran, but it does not fit
                        reason = (f"budget {format_bytes(self.budget)} ({self.budget} B) exceeded: the step's peak was "
                                  f"{format_bytes(peak)} ({peak} B) by the CUDA allocator's counter, besides "
                                  f"{outside} B allocated outside the trainer (memlab.train.BudgetTrainer, CUDA)")
                elif reason is None:
                    peak = tracker.peak_bytes
                if reason is not None:
                    self._free()
                    self._back_off(stack, reason)
                    continue
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
