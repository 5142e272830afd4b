"""Checks for chapter 07, fitting a training run into a memory budget.

07.cheapest_stack   a planner over a small search space: every divisor micro-batch x checkpointing none/full,
                    the cheapest stack whose estimated peak fits (ties: smaller peak, then earlier), None if none
07.back_off         the OOM back-off rule: halve the micro-batch to a divisor of the effective batch (same
                    effective batch), then full checkpointing, then None; every other knob kept
07.atomic_write     an atomic file writer, graded by killing it (SIGKILL in a forked child) in the middle of a
                    write: the good file must survive every torn write; temp file in the same directory,
                    that file fsync'ed with every byte on disk (after the last write and a flush) before the
                    rename, the target's directory fsync'ed after it, no temp file left after an error
07.predict_peak     derive the tracked peak of a BudgetTrainer step (TinyGPT, fp32, AdamW, SDPA, no
                    checkpointing) as a formula over the config and the stack: a function that runs the model
                    (forward, backward or optimizer step, fake tensors included) fails; graded exactly against
                    the measurement (MemoryTracker on the real run): the smallest omissions are a few bytes

The references are memlab.train.cheapest_stack, memlab.train.back_off, memlab.train.state.atomic_write and
predict_peak_formula here (a formula; memlab.train.estimate_stack_peak traces the same step on fake tensors).
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path

from memlab import train
from memlab.train import state as training_state
from memlab.course.checks import expect, expect_equal, register
from memlab.plan import Stack


# ----------------------------------------------------------------------------- 07.cheapest_stack
def _planner_cases() -> list[tuple[str, int, int, object, object]]:
    """(name, effective_batch, budget, estimate, cost). Peaks in bytes, costs in relative step time."""

    def est(params: int, act: int, ckpt_factor: float = 0.25):
        def estimate(s: Stack) -> int:
            a = act * s.micro_batch
            if s.checkpointing == "full":
                a = int(a * ckpt_factor)
            return params + (params // 4 if s.grad_accum > 1 else 0) + a
        return estimate

    def cost(per_micro: float = 0.05, recompute: float = 0.33):
        def c(s: Stack) -> float:
            return round((1.0 + per_micro * (s.grad_accum - 1)) * (1 + (recompute if s.checkpointing == "full" else 0)), 9)
        return c

    return [
        ("everything fits: the cheapest is the whole batch at once", 8, 10**9, est(1000, 100), cost()),
        ("budget 1000 + 250 + 100*2 = 1450 exactly: micro-batch 2 fits (<= budget)", 8, 1450, est(1000, 100), cost()),
        ("effective batch 12: micro-batch 4 is a divisor too (12, 6, 4, 3, 2, 1)", 12, 1250 + 100 * 4, est(1000, 100), cost()),
        ("effective batch 18: micro-batch 9 (no power of two)", 18, 1250 + 100 * 9, est(1000, 100), cost()),
        ("checkpointing beats more accumulation when recompute is cheap", 8, 1260 + 100 * 4 // 4 + 100,
         est(1000, 100), cost(per_micro=0.2, recompute=0.1)),
        ("accumulation beats checkpointing when recompute is dear", 8, 1250 + 100 * 4,
         est(1000, 100), cost(per_micro=0.05, recompute=0.5)),
        ("equal costs: the smaller peak wins", 6, 10**9, est(1000, 100), lambda s: 1.0),
        ("equal costs and peaks: the earlier candidate", 4, 10**9, lambda s: 500, lambda s: 1.0),
        ("effective batch 7 (prime): micro-batch 7 or 1 only, tight budget", 7, 1000 + 250 + 25,
         est(1000, 100), cost()),
        ("nothing fits: None", 8, 999, est(1000, 100), cost()),
        ("effective batch 8, budget 1550: micro-batch 3 would fit and be cheapest, but 3 does not divide 8 "
         "(3 x 2 is 6 sequences, 3 x 3 is 9): 2 x 4", 8, 1250 + 100 * 3, est(1000, 100), cost()),
        ("effective batch 10, budget 1650: micro-batches 4 and 3 fit but do not divide 10: 2 x 5",
         10, 1250 + 100 * 4, est(1000, 100), cost(per_micro=0.01, recompute=0.9)),
    ]


@register("07.cheapest_stack", reference=lambda: train.cheapest_stack, title="planner: the cheapest stack that fits")
def check_cheapest_stack(fn) -> None:
    """Grade exercise ``07.cheapest_stack``: planner: the cheapest stack that fits."""
    expect(callable(fn), f"cheapest_stack: expected a function, got {type(fn).__name__}")
    for name, eb, budget, estimate, cost in _planner_cases():
        got = fn(eb, budget, estimate, cost)
        want = train.cheapest_stack(eb, budget, estimate, cost)
        if got != want or type(got) is not type(want):
            detail = ""
            if isinstance(got, Stack) and want is not None:
                detail = (f" (yours: estimate {estimate(got)}, cost {cost(got)}; expected: estimate {estimate(want)}, "
                          f"cost {cost(want)}; budget {budget})")
            short = (lambda s: s if s is None else f"micro_batch={s.micro_batch}, grad_accum={s.grad_accum}, "
                     f"checkpointing={s.checkpointing!r}")
            shown = short(got) if isinstance(got, Stack) or got is None else repr(got)
            raise AssertionError(f"cheapest_stack({name}): got {shown}, expected {short(want)}{detail}")


# ----------------------------------------------------------------------------- 07.back_off
_BACK_OFF_CASES = [
    Stack(micro_batch=8),
    Stack(micro_batch=4, grad_accum=2),
    Stack(micro_batch=18),
    Stack(micro_batch=9, grad_accum=2),
    Stack(micro_batch=5, grad_accum=2),
    Stack(micro_batch=12, grad_accum=1, precision="bf16-mixed", optimizer="adamw-fused", attention="eager"),
    Stack(micro_batch=3, grad_accum=4, checkpointing="every-k", ckpt_every=2),
    Stack(micro_batch=1, grad_accum=16),
    Stack(micro_batch=1, grad_accum=8, checkpointing="every-k", ckpt_every=3, precision="bf16-pure"),
    Stack(micro_batch=1, grad_accum=8, checkpointing="full"),
]


@register("07.back_off", reference=lambda: train.back_off, title="the OOM back-off rule")
def check_back_off(fn) -> None:
    """Grade exercise ``07.back_off``: the OOM back-off rule."""
    expect(callable(fn), f"back_off: expected a function, got {type(fn).__name__}")
    for s in _BACK_OFF_CASES:
        got = fn(s)
        want = train.back_off(s)
        expect(got is None or isinstance(got, Stack),
               f"back_off({s}): expected a memlab.plan.Stack or None, got {type(got).__name__}")
        if want is None:
            expect(got is None, f"back_off({s}): nothing is left to give up, expected None, got {got}")
            continue
        expect(got is not None, f"back_off({s}): returned None, expected {want}")
        expect(got.effective_batch == s.effective_batch,
               f"back_off({s}): effective batch {got.micro_batch} x {got.grad_accum} = {got.effective_batch}, "
               f"expected {s.effective_batch} (the trainer must see the same data per optimizer step)")
        expect_equal(f"back_off({s})", got, want)


# ----------------------------------------------------------------------------- 07.atomic_write
def _fd_path(n: int) -> str | None:
    """The path an open descriptor names (Linux's /proc/self/fd), or None where that is not available."""
    try:
        return str(Path(os.readlink(f"/proc/self/fd/{n}")).resolve())
    except OSError:
        return None


class _Spy:
    """Records os.fsync / os.replace / os.rename while a writer runs (patched on the os module): for an
    fsync, whether it is a directory, its path and the file's size on disk at that moment (what a power
    cut would keep); for a rename, the source's directory and path."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.details: list[dict] = []
        self._orig = {n: getattr(os, n) for n in ("fsync", "replace", "rename")}

    def __enter__(self) -> "_Spy":
        orig = self._orig

        def fsync(fd):
            n = fd if isinstance(fd, int) else fd.fileno()
            st = os.fstat(n)
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
            self.events.append(("fsync", kind))
            self.details.append({"path": _fd_path(n), "size": st.st_size})
            return orig["fsync"](fd)

        def replace(src, dst, *a, **k):
            src_path = Path(os.fspath(src)).resolve()
            self.events.append(("replace", str(src_path.parent)))
            self.details.append({"path": str(src_path), "size": None})
            return orig["replace"](src, dst, *a, **k)

        def rename(src, dst, *a, **k):
            src_path = Path(os.fspath(src)).resolve()
            self.events.append(("replace", str(src_path.parent)))
            self.details.append({"path": str(src_path), "size": None})
            return orig["rename"](src, dst, *a, **k)

        os.fsync, os.replace, os.rename = fsync, replace, rename
        return self

    def __exit__(self, *exc) -> None:
        os.fsync, os.replace, os.rename = self._orig["fsync"], self._orig["replace"], self._orig["rename"]


def _check_durability(spy: _Spy, d: Path, nbytes: int, what: str) -> None:
    """The temp file (the renamed one) fsync'ed with all ``nbytes`` on disk before the rename, and the
    target's directory fsync'ed after it."""
    ev, det = spy.events, spy.details
    replaces = [i for i, e in enumerate(ev) if e[0] == "replace"]
    expect(len(replaces) >= 1, f"atomic_write ({what}): no os.replace / os.rename seen: write a temp file and rename "
           "it onto the path (a copy or a direct write can be torn)")
    r = replaces[-1]
    expect(ev[r][1] == str(d.resolve()),
           f"atomic_write ({what}): the temp file was in {ev[r][1]}, not in the target's directory {d}: a rename is "
           "only atomic within one file system, so create the temp file next to the target")
    expect(("fsync", "file") in ev[:r], f"atomic_write ({what}): the temp file was not os.fsync'ed before the rename: "
           "after a power cut the rename can survive while the data does not")
    tmp = det[r]["path"]
    syncs = [det[i] for i in range(r) if ev[i] == ("fsync", "file") and det[i]["path"] in (None, tmp)]
    expect(bool(syncs), f"atomic_write ({what}): the file fsync'ed before the rename is not the temp file that was "
           "renamed")
    sizes = [x["size"] for x in syncs]
    expect(max(sizes) == nbytes,
           f"atomic_write ({what}): when the temp file was fsync'ed it held {max(sizes):,} of the {nbytes:,} bytes on "
           "disk: fsync after the last write, and flush Python's buffer first (f.flush(), then os.fsync(f.fileno())): "
           "fsync only makes durable what the OS already has")
    after = [i for i in range(r + 1, len(ev)) if ev[i] == ("fsync", "dir")]
    expect(bool(after), f"atomic_write ({what}): the directory was not fsync'ed after the rename "
           "(os.open(dir, os.O_RDONLY), os.fsync, os.close): the new name itself may not be durable")
    paths = {det[i]["path"] for i in after}
    expect(None in paths or str(d.resolve()) in paths,
           f"atomic_write ({what}): the directory fsync'ed after the rename was {sorted(p for p in paths if p)}, not the "
           f"target's directory {d}: the new name is an entry of the target's directory")


def _killed_in_child(fn, path: Path, chunks: list[bytes], kill_after: int) -> int:
    """Run ``fn(path, generator)`` in a forked child that SIGKILLs itself after yielding ``kill_after``
    chunks (or when asked for the one after the last). Returns the wait status."""
    pid = os.fork()
    if pid == 0:
        try:
            def gen():
                for i, c in enumerate(chunks):
                    if i == kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
                    yield c
                os.kill(os.getpid(), signal.SIGKILL)  # the writer asked for more: it has not renamed yet

            fn(path, gen())
        finally:
            os._exit(0)
    try:
        _, status = os.waitpid(pid, 0)
    except BaseException:  # the time limit fired while the child still runs: do not leave it behind
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return status


@register("07.atomic_write", reference=lambda: training_state.atomic_write, title="atomic checkpoint writer", timeout=120)
def check_atomic_write(fn) -> None:
    """Grade exercise ``07.atomic_write``: atomic checkpoint writer."""
    expect(callable(fn), f"atomic_write: expected a function, got {type(fn).__name__}")
    d = Path(tempfile.mkdtemp(prefix="memlab-07-"))
    try:
        target = d / "model.ckpt"
        old = b"OLD complete checkpoint " * 1000
        new = [b"NEW header|", b"x" * 50_000, b"y" * 50_000, b"|NEW end"]
        # 1. a plain write, then an overwrite, with the durability calls in the right order
        with _Spy() as spy:
            fn(target, [old])
        expect(target.exists() and target.read_bytes() == old,
               "atomic_write(path, [data]): the file does not hold exactly the bytes written")
        _check_durability(spy, d, len(old), "a new file")
        with _Spy() as spy:
            fn(target, iter(new))
        expect(target.read_bytes() == b"".join(new),
               "atomic_write(path, chunks): overwriting an existing file did not leave exactly the new bytes")
        _check_durability(spy, d, len(b"".join(new)), "overwriting a file, 4 chunks")
        leftovers = sorted(p.name for p in d.iterdir() if p != target)
        expect(not leftovers, f"atomic_write: files left next to the target after a successful write: {leftovers}")
        # 2. an error while writing: the old file stays, the temp file goes
        target.write_bytes(old)

        def failing():
            yield b"partial"
            raise OSError("disk full (raised by the check)")

        try:
            fn(target, failing())
        except OSError:
            pass
        else:
            raise AssertionError("atomic_write: an OSError raised while writing was swallowed; let it propagate")
        expect(target.read_bytes() == old, "atomic_write: an error in the middle of the write replaced the good file")
        leftovers = sorted(p.name for p in d.iterdir() if p != target)
        expect(not leftovers, f"atomic_write: after a failed write the temp file is still there: {leftovers} "
               "(remove it, then re-raise)")
        # 3. kill -9 in the middle of the write: the good file must survive every torn write
        if hasattr(os, "fork") and sys.platform != "darwin":
            for k in (0, 1, 2, 3, 4):
                status = _killed_in_child(fn, target, new, k)
                expect(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
                       f"atomic_write: the writer (killed after {k} chunks) ended without being killed: "
                       "it must consume the chunks as it writes")
                got = target.read_bytes() if target.exists() else None
                expect(got == old, f"atomic_write killed with SIGKILL after {k} of {len(new)} chunks"
                       f"{' (all written, before the rename)' if k == len(new) else ''}: the file under the name is "
                       f"{'gone' if got is None else f'{len(got)} bytes, not the previous complete file'}: "
                       "a torn write replaced the good checkpoint")
                for p in d.iterdir():
                    if p != target:
                        p.unlink()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- 07.predict_peak
def _tiny(cfg: dict):
    from memlab.models import TinyGPT, TinyGPTConfig

    return TinyGPT(TinyGPTConfig(**cfg))


# Exact: the formula below equals the measurement to the byte on every graded case. The smallest terms a
# derivation could forget, measured on these cases (2-core x86_64 CPU, torch 2.13.0+cpu):
#   the 0-d tensors (the loss, backward's seed gradient, loss / k, the running sum, the last detached loss):
#     8 / 16 / 20 B at the start of the last backward (grad_accum 1 / 2 / >=3), 4 B in optimizer.step();
#   AdamW's 4-byte step counter per parameter tensor: 112 B (n_layer=2), 160 B (n_layer=3);
#   the previous tensor's `denom` still referenced inside AdamW's per-tensor loop: 4 x (c_fc bias) = 1,024 B
#     (n_embd=64, the case whose peak is the optimizer step);
#   SDPA's logsumexp: 1-6 KiB; LayerNorm's mean/rstd: 2-6 KiB; the labels' token ids (8 x effective_batch x
#     seq_len): 64 B-2 KiB; the causal-mask buffers (bool block_size^2 per block): 2-12 KiB; the gradients that
#     accumulation keeps alive (4 B x parameters): 189-463 KiB (tests/course/mutants/ch07.py: each of these FAILS).
PREDICT_ALLOWED_BYTES = 0

_PREDICT_CASES = [
    (dict(block_size=32, n_layer=2, n_head=2, n_embd=64), Stack(micro_batch=4), 32),
    (dict(block_size=32, n_layer=2, n_head=2, n_embd=64), Stack(micro_batch=2, grad_accum=2), 32),
    (dict(block_size=64, n_layer=3, n_head=4, n_embd=32), Stack(micro_batch=1, grad_accum=4), 48),
    (dict(block_size=64, n_layer=3, n_head=4, n_embd=32), Stack(micro_batch=2, grad_accum=2), 64),
    (dict(block_size=32, n_layer=2, n_head=2, n_embd=64), Stack(micro_batch=2), 4),  # the optimizer step is the peak
]


def predict_peak_formula(model_fn, stack: Stack, seq_len: int) -> int:
    """The reference: chapter 07's peak of a TinyGPT step (fp32, AdamW foreach=False, SDPA, no checkpointing),
    derived term by term from the config and the stack; nothing runs but the model's constructor
    (``model_fn()``: only its config is read). Bytes: the larger of the backward and optimizer-step peaks.
    """
    cfg = model_fn().config
    V, bs, L, a, h = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd
    mb, ga, E, s, f = stack.micro_batch, stack.grad_accum, stack.effective_batch, seq_len, 4
    # parameter tensors in model.parameters() order (lm_head is tok_emb): embeddings, per block ln_1, c_attn,
    # c_proj, ln_2, c_fc, c_proj (weights then biases), then ln_f
    sizes = [V * h, bs * h] + L * [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h] + [h, h]
    n = sum(sizes)
    weights = f * n + L * bs * bs  # + each block's bool causal-mask buffer
    grads = f * n
    adam = 2 * f * n + 4 * len(sizes)  # exp_avg, exp_avg_sq, a 0-d fp32 step counter per tensor
    ids = 2 * 8 * E * s  # x and y (int64), the whole effective batch, alive for the whole step
    # saved for backward, per block and token: 16 h-wide fp32 tensors, SDPA's logsumexp (one per head),
    # the two LayerNorms' mean and rstd; the head: logits, log-softmax, the logits' gradient (V each),
    # the embedding sum and ln_f's output (h each), the flattened targets; positions (int64) and the loss
    per_block = mb * s * (16 * f * h + f * a + 4 * f)
    head = mb * s * (3 * f * V + 2 * f * h + 8) + 8 * s + 4
    losses = 4 if ga == 1 else (8 + 4 if ga == 2 else 12 + 4)  # the loss (or loss / k), the running sum, last d
    backward = weights + adam + ids + L * per_block + head + losses + (grads if ga > 1 else 0)
    # AdamW(foreach=False): sqrt and the division make two tensors of the parameter's size while the previous
    # tensor's denom is still referenced; the last micro-batch's 0-d loss is alive
    temp = f * max(2 * k + (sizes[i - 1] if i else 0) for i, k in enumerate(sizes))
    optimizer = weights + grads + adam + ids + temp + 4
    return max(backward, optimizer)


class _RanTheModel(Exception):
    pass


def _forbid_running(fn, *args):
    """Call fn with a global forward pre-hook and optimizer pre-hook that raise: a prediction that runs the
    model (for real, on the meta device or under FakeTensorMode) is a trace, not a derivation."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def stop(*_):
        raise _RanTheModel()

    h1, h2 = register_module_forward_pre_hook(stop), register_optimizer_step_pre_hook(stop)
    real_backward = torch.autograd.backward

    def no_backward(*a, **k):
        raise _RanTheModel()

    torch.autograd.backward = no_backward
    try:
        return fn(*args)
    finally:
        h1.remove()
        h2.remove()
        torch.autograd.backward = real_backward


@register("07.predict_peak", reference=lambda: predict_peak_formula,
          title="predict a stack's peak, then measure", timeout=240)
def check_predict_peak(fn) -> None:
    """Grade exercise ``07.predict_peak``: predict a stack's peak, then measure."""
    expect(callable(fn), f"predict_peak: expected a function, got {type(fn).__name__}")
    for cfg, stack, seq_len in _PREDICT_CASES:
        model_fn = functools.partial(_tiny, cfg)
        where = (f"predict_peak(TinyGPT({', '.join(f'{k}={v}' for k, v in cfg.items())}), micro_batch={stack.micro_batch}, "
                 f"grad_accum={stack.grad_accum}, seq_len={seq_len})")
        try:
            predicted = _forbid_running(fn, model_fn, stack, seq_len)
        except _RanTheModel:
            predicted = None
        expect(predicted is not None,
               f"{where}: your function ran the model (a forward, a backward or an optimizer step, fake tensors "
               "included): the exercise asks for a derivation, a formula over the config and the stack, not a trace")
        expect(type(predicted) is int,
               f"{where}: expected a whole number of bytes, exactly an int (convert NumPy or tensor values with "
               f"int()), got {type(predicted).__name__}")
        measured = train.measure_stack_peak(model_fn, stack, seq_len)
        n_tensors = len(list(model_fn().parameters()))
        allowed = PREDICT_ALLOWED_BYTES
        expect(abs(predicted - measured) <= allowed,
               f"{where}: predicted {predicted:,} bytes, measured {measured:,} ({predicted - measured:+,} B; "
               f"allowed {'exactly' if not allowed else f'+-{allowed} B'}: every term counts, down to the 0-d losses "
               f"(4 B each); AdamW's step counters are {4 * n_tensors} B here, the labels "
               f"{8 * stack.effective_batch * seq_len:,} B). The peak is the larger of the last micro-batch's backward "
               "(as it starts) and the optimizer step of the steady state (a second step: AdamW's state exists)")


__all__ = ["check_cheapest_stack", "check_back_off", "check_atomic_write", "check_predict_peak", "predict_peak_formula"]
