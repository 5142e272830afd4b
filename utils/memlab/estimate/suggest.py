"""What would make it fit: each technique of the course re-estimated (traced) or, where the estimator
cannot express it, a byte formula; and the ``memlab estimate`` command that reproduces a traced row."""
from __future__ import annotations

import gc
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from memlab.core import vocab
from memlab.core.forking import TwoProcesses, before_first_trace, in_two, spare_cpu
from memlab.core.vocab import Recipe
from memlab.estimate.api import estimate_training_memory
from memlab.estimate.recipes import FRAGMENTATION_MARGIN, LOSS_ALIASES, MIXED
from memlab.estimate.result import MemoryEstimate


@dataclass
class Suggestion:
    """One technique and the peak it leads to (``how``: "traced", re-estimated, or "formula")."""

    technique: str
    peak_bytes: int
    how: str  # "traced" (re-ran the estimator) or "formula"
    chapter: str = ""
    detail: str = ""
    phase: str = ""
    fwd_bwd_peak: int = 0
    extra_bytes: int = 0  # extras on the target (cuBLAS workspaces), counted in allocated/reserved
    command: str = ""  # the memlab estimate command that reproduces a traced row ("" for a formula)
    reserved_replay_bytes: int = 0  # a traced row's reserved figure by the caching allocator's model (0: none)

    def saving(self, base: MemoryEstimate) -> int:
        """Bytes saved against ``base``: ``base.peak_bytes - self.peak_bytes``."""
        return base.peak_bytes - self.peak_bytes

    @property
    def reserved_bytes(self) -> int:
        """The reserved estimate on a CUDA target (a traced row: the caching allocator's replay; a formula row: with
        extras and the fragmentation margin), else the peak."""
        alloc = self.peak_bytes + self.extra_bytes
        if self.reserved_replay_bytes:
            return max(self.reserved_replay_bytes, alloc)
        return int(math.ceil(alloc * FRAGMENTATION_MARGIN)) if self.extra_bytes else alloc


# QLoRA (Dettmers et al. 2023, section 3): NF4 weights take 4 bits per parameter; double
# quantization brings the quantization constants to 0.127 bits per parameter.
QLORA_BITS_PER_PARAM = 4 + 0.127


def estimate_command(model: Any, **kw: Any) -> str:
    """The shell-quoted ``memlab estimate`` command line for keywords of :func:`estimate_training_memory`
    (defaults left out, recipes and optimizers in their canonical spelling; a model that is no name or
    path shows as ``MODEL``)."""
    import shlex

    from memlab.estimate import adapters

    out = ["memlab", "estimate", model if isinstance(model, str) else "MODEL"]
    flags = (("batch_size", "--batch-size", None), ("seq_len", "--seq-len", None), ("dtype", "--dtype", Recipe.BF16_MIXED.value),
             ("optimizer", "--optimizer", "adamw"), ("optimizer_impl", "--optimizer-impl", "auto"),
             ("device", "--device", "cuda"), ("loss", "--loss", "auto"), ("attn_implementation", "--attn", "auto"),
             ("world_size", "--world-size", 1), ("zero_stage", "--zero-stage", 0), ("gpu", "--gpu", None),
             ("grad_accum", "--grad-accum", 1), ("fsdp_version", "--fsdp-version", 2))
    canon = {"dtype": lambda v: vocab.canonical_recipe(v, argument="dtype"), "optimizer": vocab.canonical_optimizer,
             "loss": lambda v: LOSS_ALIASES.get(v, v)}
    for key, flag, default in flags:
        if key in kw and canon.get(key, lambda v: v)(kw[key]) != default:
            out += [flag, str(canon.get(key, lambda v: v)(kw[key]))]
    for key in ("checkpointing", "offload_checkpoints", "optimizer_in_backward", "keep_previous_outputs"):
        if kw.get(key):
            out.append("--" + key.replace("_", "-"))
    if kw.get("zero_grad_set_to_none") is False:  # the loop zeroes its gradients in place (kept between steps)
        out.append("--zero-grad-keep")
    if isinstance(kw.get("step"), str):
        out += ["--step", kw["step"]]
    if kw.get("allow_longer_seq"):
        out.append("--allow-longer-seq")
    if kw.get("extrapolate") is False:
        out.append("--no-extrapolate")
    if (kw.get("optimizer_kwargs") or {}).get("offload_gradients"):
        out.append("--offload-gradients")
    for k, v in (kw.get("config_overrides") or {}).items():
        out += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    ad = adapters.adapter_spec(kw.get("adapter"), recipe=canon["dtype"](kw.get("dtype", Recipe.BF16_MIXED.value)),
                                **{k: kw[k] for k in ("lora_r", "lora_alpha", "target_modules", "lora_dropout",
                                                      "adapter_dtype") if k in kw})
    if ad is not None:
        out += ad.cli_args()
    return " ".join(shlex.quote(x) for x in out)


def _fwd_bwd(est: MemoryEstimate) -> int:
    return max(est.phase_peaks.get("forward", 0), est.phase_peaks.get("backward", 0))


def suggestions(base: MemoryEstimate, model: Any, *, config_overrides: Mapping[str, Any] | None = None,
                jobs: int | None = None, speculation: "Speculation | None" = None,
                **run_kwargs: Any) -> list[Suggestion]:
    """Techniques that lower ``base``'s peak, each with its estimated peak.

    Options the estimator has (checkpointing, the fused linear and the chunked cross-entropy, offloaded checkpoint
    inputs, the optimizer step in backward, 8-bit AdamW, the fused AdamW where the foreach one's
    temporaries set the peak, pure bf16, a smaller batch or sequence) are re-estimated ("traced"); the others use a byte formula ("formula"): CPU-offloaded AdamW (chapter 04)
    removes the optimizer state and the fp32 master copy from the GPU; LoRA (chapter 06) keeps
    the frozen weights in 16 bits with no gradients or optimizer state for them; QLoRA stores
    them in NF4. LoRA and QLoRA (rank 16, every linear layer but the head, :mod:`memlab.estimate.adapters`)
    are traced where ``base`` is a full fine-tune, QLoRA with the same adapters where it is a LoRA run; each traced row carries the ``memlab estimate``
    command that reproduces it (``Suggestion.command``).

    ``model``, ``config_overrides`` and ``run_kwargs`` (device, loss, attention, adapter settings ...) are
    what ``base`` was estimated with. The suggestions come in the order they were tried.

    ``jobs``: processes that trace the rows: None (the default) is 2 where this process may fork a second one
    (:func:`memlab.core.forking.spare_cpu`: two CPUs or more, no memlab child already beside it), else 1. With 2, a
    child of this process, with everything it has imported, traces about half of the rows while this one traces the
    rest, the one done first taking the other's rows not yet started (:func:`_traced_in_two`); the child is forked
    when the first row, started here, turns out to trace (not read from the trace cache: then the others are read
    here too). 1 traces them one after another here. The rows are the same either way
    (``tests/ch01/test_estimate_speed_paths.py``, ``tests/ch01/test_estimate_speed_split.py``).

    ``speculation``: a :class:`Speculation` started before ``base`` was traced (``memlab estimate --gpu``): the rows it
    guessed come from it, the others are made here (``jobs`` is then not used; ``tests/ch01/test_estimate_speculation.py``).
    """
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs={jobs!r} is invalid; allowed: None (2 where this process may run on two CPUs), "
                         f"or an int >= 1")
    common = _common(base, config_overrides, run_kwargs)
    extra = sum(base.extras.values())
    todo, n_before_formula, adapters_optional = _tried(base, run_kwargs)

    def made(i: int, summary: tuple) -> Suggestion:  # the row from its estimate's _summary
        technique, chapter, change = todo[i]
        peak, phase, fwd_bwd, reserved = summary
        return Suggestion(technique, peak, "traced", chapter, ", ".join(f"{k}={v}" for k, v in change.items()),
                          phase, fwd_bwd, extra, command=estimate_command(model, **{**common, **change}),
                          reserved_replay_bytes=reserved)

    def row(i: int) -> Suggestion:
        if gc_frozen:  # what the rows before left alive is not scanned again by the next full collection
            gc.freeze()
        return made(i, _summary(estimate_training_memory(model, **{**common, **todo[i][2]})))

    # Each row makes some 10^5 Python objects that outlive it (caches, modules), and the collector's full passes
    # rescan everything alive (torch, transformers: some 4 x 10^5 objects): a tenth of the rows' time. Frozen
    # (gc.freeze) before each row, they are skipped; unfrozen after the last, so nothing stays out of the collector
    # (not where the caller froze objects itself). A forked child shares them without copying their pages.
    gc_frozen = gc.get_freeze_count() == 0
    try:
        done = None if speculation is None else speculation.rows(todo, common, row, made)
        return _rows(todo, row, jobs, base, extra, n_before_formula, adapters_optional, done)
    finally:
        if gc_frozen:
            gc.unfreeze()


def _common(base: Any, config_overrides: Mapping[str, Any] | None, run_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    # the keywords every row shares: the base's step, the model's overrides, the caller's settings
    return dict(batch_size=base.batch_size, seq_len=base.seq_len, dtype=base.dtype, optimizer=base.optimizer,
                checkpointing=base.checkpointing, config_overrides=config_overrides, **run_kwargs)


def _summary(est: MemoryEstimate) -> tuple[int, str, int, int]:
    # what a traced row shows of its estimate: (peak bytes, peak phase, forward/backward peak, reserved by the replay)
    return est.peak_bytes, est.peak_phase, _fwd_bwd(est), est.reserved_replay_bytes


def _tried(base: MemoryEstimate, run_kwargs: Mapping[str, Any]) -> tuple[list[tuple[str, str, dict[str, Any]]], int, bool]:
    """The techniques :func:`suggestions` tries for ``base``, in order: ``(technique, chapter, the change)`` each;
    how many come before the adapters; whether the adapter rows may fail (a model without linear layers)."""
    todo: list[tuple[str, str, dict[str, Any]]] = []  # (technique, chapter, the change), in the order tried

    def want(technique: str, chapter: str, **change: Any) -> None:
        todo.append((technique, chapter, change))

    if not base.checkpointing:
        want("gradient checkpointing", "02", checkpointing=True)
    if base.loss in ("hf", "chunked"):  # a transformers model's loss: the logits and their fp32 copies go
        want("fused linear cross-entropy (logits never materialised)", "09", loss="fused")
    if base.loss == "hf":  # the logits made a chunk of tokens at a time (memlab.loss.chunked_cross_entropy)
        want("chunked cross-entropy (logits a chunk of tokens at a time)", "09", loss="chunked")
    if base.checkpointing and not base.offload_checkpoints and base.device.startswith("cuda"):
        want("offloaded checkpoint inputs (host memory)", "09", offload_checkpoints=True)
    if not base.optimizer_in_backward and base.optimizer != "offload-adamw" and run_kwargs.get("grad_accum", 1) == 1 \
            and base.world_size == 1 and base.zero_stage == 0:
        want("optimizer step in backward (no whole gradient; no accumulation)", "09", optimizer_in_backward=True)
    if base.optimizer == "adamw" and base.optimizer_impl == "foreach" and base.peak_phase == "optimizer":
        want("fused AdamW (no foreach temporaries)", "01", optimizer_impl="fused")
    if base.optimizer == "adamw":
        want("8-bit AdamW (bitsandbytes)", "06", optimizer="adamw8bit")
    if base.dtype != Recipe.BF16_PURE:
        want("pure bf16 weights and AdamW state (no fp32 master copy)", "03", dtype=Recipe.BF16_PURE.value)
    if not base.checkpointing and base.optimizer == "adamw":
        want("gradient checkpointing + 8-bit AdamW", "02+06", checkpointing=True, optimizer="adamw8bit")
    if base.batch_size > 1:
        want(f"batch size {base.batch_size // 2} (x2 gradient accumulation)", "", batch_size=base.batch_size // 2)
    if base.seq_len > 1:
        want(f"sequence length {base.seq_len // 2}", "", seq_len=base.seq_len // 2)
    n_before_formula = len(todo)
    if base.adapter:
        if base.adapter.startswith("lora"):  # the same adapters on an NF4 base (QLoRA, chapter 06)
            want("QLoRA (the same adapters on NF4 frozen weights)", "06", adapter="qlora")
        adapters_optional = False
    else:
        # LoRA / QLoRA traced (memlab.estimate.adapters): a 16-bit recipe (bf16 mixed for an fp32 run), AdamW on the
        # adapters; skipped for a model without linear layers to adapt (a ValueError)
        ad_kw = dict(dtype=Recipe.BF16_MIXED.value if base.dtype == Recipe.FP32 else base.dtype,
                     optimizer="adamw" if base.optimizer == "offload-adamw" else base.optimizer, optimizer_kwargs=None)
        want("LoRA on 16-bit frozen weights (rank 16, all linear layers)", "06", adapter="lora", **ad_kw)
        want("QLoRA (NF4 frozen weights, rank 16, all linear layers)", "06", adapter="qlora", **ad_kw)
        adapters_optional = True
    return todo, n_before_formula, adapters_optional


def _rows(todo: list, row: Any, jobs: int | None, base: MemoryEstimate, extra: int, n_before_formula: int,
          adapters_optional: bool, done: dict[int, Any] | None = None) -> list[Suggestion]:
    # the rows in the order tried, with the formula row among them: traced in two processes at once, else here one
    # after another. The first row starts here, and the second process is forked when it turns out to trace (not
    # read from the trace cache: a repeated command reads all its rows in milliseconds, where a second process
    # would only cost its start), taking its share of the other rows at once
    n_jobs = _default_jobs() if jobs is None else jobs
    if done is not None:  # every row made already (a speculation's and this process's)
        n_jobs = 1
    done = {} if done is None else done
    if n_jobs >= 2 and len(todo) >= 3:
        rest = list(range(1, len(todo)))
        pair: list[Any] = []

        def fork() -> None:
            try:
                pair.append(_two_processes(row, rest, _weights([todo[i] for i in rest])))
            except OSError:  # no process to be had: the rows are traced here
                pass

        try:
            with before_first_trace(fork):
                done[0] = _run_row(row, 0)
            if pair:
                done.update(pair[0].finish())
        finally:
            for p in pair:
                p.close()

    def result(i: int) -> Suggestion:  # a row traced in two processes, else traced now (in the order tried)
        if i not in done:
            return row(i)
        r = done[i]
        if isinstance(r, BaseException):
            raise r
        return r

    out: list[Suggestion] = [result(i) for i in range(n_before_formula)]
    # Formulas, from the traced breakdowns.
    P = base.n_params
    opt_at_peak = base.breakdown.get("optimizer", 0)
    # fp32 weights that become 16-bit on the GPU (an adapter's frozen base is 16-bit already)
    master = 2 * P if base.dtype in MIXED and not base.adapter else 0
    out.append(Suggestion("CPU-offloaded AdamW (optimizer state and fp32 master weights in CPU RAM)",
                          max(base.peak_bytes - opt_at_peak - master, 0), "formula", "04",
                          "peak - optimizer state at peak" + (" - 2 bytes/param (fp32 weights kept as 16-bit)" if master else ""),
                          extra_bytes=extra))
    for i in range(n_before_formula, len(todo)):
        try:
            out.append(result(i))
        except ValueError:  # a model without linear layers to adapt: LoRA (and so QLoRA) not suggested
            if not adapters_optional:
                raise
            if i == n_before_formula:
                break
    return out


# The relative cost of a traced row: the seconds of each row of `memlab estimate llama-2-7b --gpu rtx4090` in the two
# processes, a plain row 1 (0.40 s; 2 cores, 2026-11-29): the adapters build more modules and run more ops (LoRA 0.90,
# QLoRA 0.82 s), the optimizer in backward runs one optimizer per tensor (0.76 s), checkpointing recomputes (0.63 s),
# a loss, a sequence or a dtype changed costs a little more (0.44-0.50 s), another optimizer less (0.33-0.36 s). A
# row's weight is the largest of its changes': ordered by it, the two processes end on the cheap rows.
_ROW_WEIGHTS = (("adapter", 2.2), ("optimizer_in_backward", 1.9), ("checkpointing", 1.4), ("loss", 1.15),
                ("seq_len", 1.15), ("dtype", 1.1), ("optimizer", 0.85), ("optimizer_impl", 0.85))


def _weights(todo: list[tuple[str, str, dict[str, Any]]]) -> list[float]:
    return [max([w for key, w in _ROW_WEIGHTS if change.get(key)] or [1.0]) for _, _, change in todo]


def _default_jobs() -> int:
    """2 where this process may fork a second one now (memlab.core.forking.spare_cpu: two CPUs or more), else 1."""
    return 2 if spare_cpu() else 1


def _split(weights: list[float]) -> set[int]:
    """The rows a second process traces: the last ones, until they weigh half of all (the adapters, which share
    first-use work such as memlab.quant's codebooks, stay together at the end)."""
    half, mine, total = sum(weights) / 2, set(), 0.0
    for i in reversed(range(len(weights))):
        if total >= half or len(mine) == len(weights) - 1:
            break
        mine.add(i)
        total += weights[i]
    return mine


def _run_row(row: Any, i: int) -> Any:
    try:
        return row(i)
    except Exception as exc:  # noqa: BLE001  (raised by the caller, in the order tried)
        return exc


def _shares(rows: list[int], weights: list[float]) -> tuple[list[int], list[int]]:
    # (this process's rows, the child's): the child the last rows, about half the work (_split); each the slowest
    # of its own first (in the order tried among equals)
    split = _split(weights)
    by_cost = sorted(range(len(rows)), key=lambda k: -weights[k])
    return [rows[k] for k in by_cost if k not in split], [rows[k] for k in by_cost if k in split]


def _two_processes(row: Any, rows: list[int], weights: list[float]) -> TwoProcesses:
    # the child forked now, on its share of ``rows`` (:func:`_traced_in_two`)
    return TwoProcesses(row, *_shares(rows, weights))


def _traced_in_two(row: Any, rows: list[int], weights: list[float]) -> dict[int, Any]:
    """{row index: its Suggestion, or the exception it raised} for the row indices ``rows`` (``weights``: their
    relative costs), traced by this process and a forked child at once (:func:`memlab.core.forking.in_two`: the
    child inherits every import and the warm state, so it starts in milliseconds). The child starts on the last rows,
    about half the work (:func:`_split`), this process on the others, each the slowest of its own first; the one
    done first takes the other's rows not yet started. A child that fails leaves its rows out of the answer: the
    caller traces them here in order, so the rows are those of one process in every case."""
    return in_two(row, *_shares(rows, weights))


class Speculation:
    """The suggestion rows of an estimate traced ahead, by a forked child, while this process still traces the
    estimate they are for (``memlab estimate MODEL --gpu CARD``: the imports are done, the second CPU idle).

    The rows are those :func:`suggestions` will try for a base whose settings are the command's (``provisional``: the
    fields :func:`_tried` reads, the loss resolved as a transformers model's and no peak phase known, so the fused
    AdamW row, which depends on it, is not among them); each row is ``estimate_training_memory(model, **kw)`` with
    the keywords :func:`suggestions` will give it. The child takes them the costliest first
    (:class:`memlab.core.forking.TwoProcesses`); :meth:`rows`, called by :func:`suggestions` once the estimate is known,
    makes here every row the speculation did not guess (its keywords differ), then the guessed rows the child has
    not started, and takes the child's results: each row is what the same call would return here, so the
    suggestions are the same (``tests/ch01/test_estimate_speculation.py``). :meth:`close` stops the child (an
    estimate that fits needs no suggestions).
    """

    def __init__(self, model: Any, provisional: Any, config_overrides: Mapping[str, Any] | None,
                 run_kwargs: Mapping[str, Any]) -> None:
        todo, _, _ = _tried(provisional, run_kwargs)
        common = _common(provisional, config_overrides, run_kwargs)
        self.model, self.kws = model, [{**common, **change} for _, _, change in todo]
        self._parent = os.getpid()
        order = sorted(range(len(todo)), key=lambda k: -_weights(todo)[k])  # the costliest first
        # this process, joining when its estimate is done, takes the next costliest row left too: both end on cheap ones
        self.pair = TwoProcesses(self._one, order[-1:], order[:-1], steal_from_front=True) if len(order) >= 2 else None
        self._done: dict[int, Any] | None = None

    def _one(self, k: int) -> tuple[int, str, int, int]:
        if os.getpid() != self._parent and "transformers" in sys.modules:
            # the child builds the model this process builds: its warnings are this process's, said once here
            sys.modules["transformers"].logging.set_verbosity_error()
        return _summary(estimate_training_memory(self.model, **self.kws[k]))

    def rows(self, todo: list, common: dict[str, Any], row: Any, made: Any) -> dict[int, Any]:
        """``{row index: its Suggestion, or the exception it raised}`` for every row of ``todo`` (``common``: the rows'
        shared keywords; ``row(i)`` makes row ``i`` here, ``made(i, summary)`` makes it from a traced summary)."""
        guessed = {i: self.kws.index(kw) for i, kw in enumerate({**common, **c} for _, _, c in todo) if kw in self.kws}
        done = {i: _run_row(row, i) for i in range(len(todo)) if i not in guessed}
        if self._done is None:
            self._done = self.pair.finish() if self.pair is not None else {}
        for i, k in guessed.items():
            r = self._done.get(k)
            done[i] = _run_row(row, i) if r is None else r if isinstance(r, BaseException) else made(i, r)
        return done

    def close(self) -> None:
        """Stop the child if it still runs (idempotent)."""
        if self.pair is not None:
            self.pair.close()
