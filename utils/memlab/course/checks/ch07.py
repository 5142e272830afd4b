"""Checks for chapter 07, fitting a training run into a memory budget.

07.cheapest_stack   a planner over a small search space: every divisor micro-batch x checkpointing none/full,
                    the cheapest stack whose estimated peak fits (ties: smaller peak, then earlier), None if none;
                    the hand-picked cases, then 60 drawn (any effective batch, budget, estimate and cost)
07.back_off         the OOM back-off rule: halve the micro-batch to a divisor of the effective batch (same
                    effective batch), then full checkpointing, then None; every knob the trainer uses kept
                    (ckpt_every only counts under "every-k"); 80 drawn stacks beside the hand-picked ones
07.atomic_write     an atomic file writer, graded by what a crash leaves: killed (SIGKILL in a forked child) in
                    the middle of a write, the good file survives; a power cut simulated before every fsync,
                    fdatasync, sync and rename the writer makes (whichever name it calls them by) leaves the old
                    file or the new one, never a torn one, and only the new one once the write returned; the
                    temp file in the target's directory, none left after an error
07.predict_peak     derive the peak of a BudgetTrainer step (TinyGPT, fp32, AdamW, SDPA, no checkpointing) as a
                    formula over the config and the stack: a function that runs the model (forward, backward or
                    optimizer step, fake tensors included) fails; graded against the lecture's model of the step
                    (predict_peak_bounds: to the byte, the 0-d tensors and AdamW's previous denom optional) on 40
                    drawn configurations (depth, heads, head size, vocabulary, MLP ratio, micro-batch, accumulation,
                    length), and that model against the measurement (MemoryTracker on the real run) on the lab's five
                    stacks, which it equals to the byte

The references are memlab.train.cheapest_stack, memlab.train.back_off, memlab.train.state.atomic_write and
predict_peak_formula here (a formula; memlab.train.estimate_stack_peak traces the same step on fake tensors).
"""
from __future__ import annotations

import dataclasses
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
from memlab.course.checks import (Space, differential, expect, expect_equal, flags, floats, ints, one_of, own_copies,
                                  register)
from memlab.plan import Stack


# ----------------------------------------------------------------------------- 07.cheapest_stack
def _estimate(params: int, act: int, ckpt_factor: float = 0.25):
    """A stack's estimated peak: weights and state, a quarter more with accumulation, activations by micro-batch."""
    def estimate(s: Stack) -> int:
        a = act * s.micro_batch
        if s.checkpointing == "full":
            a = int(a * ckpt_factor)
        return params + (params // 4 if s.grad_accum > 1 else 0) + a
    return estimate


def _cost(per_micro: float = 0.05, recompute: float = 0.33):
    """A stack's relative step time: each extra micro-batch costs ``per_micro``, recomputation ``recompute``."""
    def c(s: Stack) -> float:
        return round((1.0 + per_micro * (s.grad_accum - 1)) * (1 + (recompute if s.checkpointing == "full" else 0)), 9)
    return c


def _planner_cases() -> list[tuple[str, int, int, object, object]]:
    """(name, effective_batch, budget, estimate, cost): the hand-picked edges. Peaks in bytes, costs in relative step time."""
    est, cost = _estimate, _cost
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


# the planner's input space: any effective batch (primes, odd, powers of two); a budget exactly at one
# candidate's estimate (each divisor's turn to be the answer), between two, below all or above all; costs where
# accumulation or checkpointing wins, and flat costs (ties decided by the peak, then by the candidate order)
PLANNER_SPACE = Space(
    effective_batch=ints(1, 40), params=ints(0, 5000), act=ints(1, 600), ckpt_factor=one_of(0.25, 0.5, 0.1, 1.0),
    per_micro=one_of(0.05, 0.2, 0.01, 0.0), recompute=one_of(0.33, 0.1, 0.5, 0.9, 0.0),
    budget=one_of("at a candidate", "between two", "at a candidate", "below all", "above all"), pick=ints(0, 1000),
)


def _drawn_planner_case(case) -> tuple[str, int, int, object, object]:
    estimate, cost = _estimate(case.params, case.act, case.ckpt_factor), _cost(case.per_micro, case.recompute)
    eb = case.effective_batch
    divisors = [m for m in range(1, eb + 1) if eb % m == 0]
    peaks = sorted({estimate(Stack(micro_batch=m, grad_accum=eb // m, checkpointing=c))
                    for m in divisors for c in ("none", "full")})
    # "at a candidate": exactly the estimate of micro-batch m without checkpointing, m any divisor in turn
    m = divisors[case.pick % len(divisors)]
    budget = {"at a candidate": estimate(Stack(micro_batch=m, grad_accum=eb // m)), "below all": peaks[0] - 1 - case.pick,
              "above all": peaks[-1] + case.pick,
              "between two": (peaks[case.pick % len(peaks)] + peaks[min(case.pick % len(peaks) + 1, len(peaks) - 1)]) // 2,
              }[case.budget]
    return f"drawn case ({case}): effective batch {eb}, budget {budget}", eb, budget, estimate, cost


def _short_stack(s):
    return s if s is None else f"micro_batch={s.micro_batch}, grad_accum={s.grad_accum}, checkpointing={s.checkpointing!r}"


@register("07.cheapest_stack", reference=lambda: train.cheapest_stack, title="planner: the cheapest stack that fits")
def check_cheapest_stack(fn) -> None:
    """Grade exercise ``07.cheapest_stack``: planner: the cheapest stack that fits."""
    expect(callable(fn), f"cheapest_stack: expected a function, got {type(fn).__name__}")

    def run(case) -> None:
        name, eb, budget, estimate, cost = case.planner if hasattr(case, "planner") else _drawn_planner_case(case)
        want = train.cheapest_stack(*own_copies(eb, budget), estimate, cost)  # the reference first, on its own copies
        got = fn(eb, budget, estimate, cost)
        if got != want or type(got) is not type(want):
            detail = ""
            if isinstance(got, Stack) and want is not None:
                detail = (f" (yours: estimate {estimate(got)}, cost {cost(got)}; expected: estimate {estimate(want)}, "
                          f"cost {cost(want)}; budget {budget})")
            shown = _short_stack(got) if isinstance(got, Stack) or got is None else repr(got)
            raise AssertionError(f"cheapest_stack({name}): got {shown}, expected {_short_stack(want)}{detail}")

    differential(PLANNER_SPACE, run, edges=[{"planner": c} for c in _planner_cases()], examples=200)


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

# every knob of a Stack varied: micro-batches with many divisors, primes, 1; every checkpointing mode
BACK_OFF_SPACE = Space(
    small=flags(), micro_batch=lambda c: ints(1, 3) if c.small else ints(1, 64), grad_accum=ints(1, 12), checkpointing=one_of("none", "every-k", "full", "selective"),
    ckpt_every=ints(1, 6), precision=one_of("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"),
    optimizer=one_of("adamw", "adamw-fused", "adamw8bit", "offload-adamw"), adapter=one_of("full", "lora", "qlora"),
    attention=one_of("sdpa", "eager", "flash"),
)


def _what_trains(s: Stack) -> dict:
    """The knobs the trainer acts on: ``ckpt_every`` only matters under "every-k" (a stack that resets it to
    1 when it moves to full checkpointing trains the same way)."""
    fields = dataclasses.asdict(s)
    if s.checkpointing != "every-k":
        fields.pop("ckpt_every")
    return fields


@register("07.back_off", reference=lambda: train.back_off, title="the OOM back-off rule")
def check_back_off(fn) -> None:
    """Grade exercise ``07.back_off``: the OOM back-off rule."""
    expect(callable(fn), f"back_off: expected a function, got {type(fn).__name__}")

    def run(case) -> None:
        s = case.stack if hasattr(case, "stack") else Stack(**{k: v for k, v in vars(case).items()
                                                              if k not in ("seed", "small")})
        want = train.back_off(own_copies(s)[0])  # the reference first, on its own copy
        got = fn(s)
        expect(got is None or type(got) is Stack,
               f"back_off({s}): expected a memlab.plan.Stack or None, got {type(got).__name__}")
        if want is None:
            expect(got is None, f"back_off({s}): nothing is left to give up, expected None, got {got}")
            return
        expect(got is not None, f"back_off({s}): returned None, expected {want}")
        expect(got.effective_batch == s.effective_batch,
               f"back_off({s}): effective batch {got.micro_batch} x {got.grad_accum} = {got.effective_batch}, "
               f"expected {s.effective_batch} (the trainer must see the same data per optimizer step)")
        expect_equal(f"back_off({s}): the knobs the trainer uses", _what_trains(got), _what_trains(want))

    differential(BACK_OFF_SPACE, run, edges=[{"stack": s} for s in _BACK_OFF_CASES], examples=80)


# ----------------------------------------------------------------------------- 07.atomic_write
_OBSERVED = ("fsync", "fdatasync", "sync", "replace", "rename")


def _content_of_fd(fd: int) -> bytes:
    """The bytes of the file open as ``fd`` (a write-only descriptor too: reopened through /proc on Linux)."""
    try:
        rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    except OSError:
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0)
    try:
        with os.fdopen(rfd, "rb") as f:
            return f.read()
    except OSError:
        return b""


class _PowerCut:
    """What a power cut could leave under ``target``'s name at every step of one write.

    os.fsync, os.fdatasync, os.sync, os.replace and os.rename are observed, in the os module and wherever the
    answer's own globals bound them (``from os import replace``), then done for real: the answer may use any of
    them, the check judges the file. The model is a journaling file system's (Linux ext4, data=ordered): a file's
    bytes are durable as they were at its last fsync or fdatasync, or anything in between when it changed since;
    the directory's entries change in order and are durable from the directory's last fsync (or os.sync). Before
    each observed call, and after the write returns, every state a crash could leave is recorded."""

    def __init__(self, target: Path, answer: tuple[dict | None, list]) -> None:
        self.target, self.dir = target, target.parent
        answer_globals, self.cells = answer
        self.dir_ino = os.stat(self.dir).st_ino
        self.globals = answer_globals
        st = os.stat(target) if target.exists() else None
        self.bound = st.st_ino if st else None  # the inode under the name now
        self.durable_bound = self.bound  # ... and after a power cut, once the directory is synced
        self.pending: list[int | None] = []  # the name's bindings since the directory's last sync, in order
        self.durable: dict[int, bytes] = {st.st_ino: target.read_bytes()} if st else {}
        self.crashes: list[tuple[str, list]] = []  # (when, the states a power cut then could leave)
        self.renamed_from: list[str] = []

    def _now(self, ino: int | None) -> bytes | None:
        """The bytes of inode ``ino`` now, when it is the one under the name (else what is durable)."""
        if ino is not None and ino == self.bound and self.target.exists():
            return self.target.read_bytes()
        return self.durable.get(ino) if ino is not None else None

    def crash(self, when: str) -> None:
        states = []
        for ino in dict.fromkeys([self.durable_bound, *self.pending]):
            if ino is None:
                states.append(("gone", None))
            elif ino not in self.durable:
                states.append(("never synced", self._now(ino)))
            elif self._now(ino) != self.durable[ino]:
                states.append(("changed since its last sync", self._now(ino)))
            else:
                states.append(("durable", self.durable[ino]))
        self.crashes.append((when, states))

    def _observed(self, name: str, real):
        def fsync_like(fd):
            n = fd if isinstance(fd, int) else fd.fileno()
            st = os.fstat(n)
            if stat.S_ISDIR(st.st_mode):
                self.crash(f"just before the {name} of a directory")
                real(fd)
                if st.st_ino == self.dir_ino:
                    self.durable_bound, self.pending = self.bound, []
                return None
            self.crash(f"just before os.{name} of a file ({st.st_size:,} bytes)")
            real(fd)
            self.durable[st.st_ino] = _content_of_fd(n)
            return None

        def sync():
            self.crash("just before os.sync()")
            real()
            if self.bound is not None:
                self.durable[self.bound] = self.target.read_bytes()
            self.durable_bound, self.pending = self.bound, []

        def rename_like(src, dst, *a, **k):
            src_p, dst_p = Path(os.fspath(src)).resolve(), Path(os.fspath(dst)).resolve()
            self.crash(f"just before os.{name}({src_p.name!r} -> {dst_p.name!r})")
            src_ino = os.stat(src_p).st_ino if src_p.exists() else None
            out, target = real(src, dst, *a, **k), self.target.resolve()
            if dst_p == target:
                self.renamed_from.append(str(src_p.parent))
                self.bound = src_ino
                self.pending.append(self.bound)
            elif src_p == target:
                self.bound = None
                self.pending.append(None)
            return out

        return {"sync": sync, "replace": rename_like, "rename": rename_like}.get(name, fsync_like)

    def __enter__(self) -> "_PowerCut":
        self.real = {n: getattr(os, n) for n in _OBSERVED if hasattr(os, n)}
        spies = {n: self._observed(n, f) for n, f in self.real.items()}
        for n, f in spies.items():
            setattr(os, n, f)
        self.rebound, self.recelled = [], []
        for key, value in list((self.globals or {}).items()):
            for n, f in self.real.items():
                if value is f:  # the answer imported it by name: observe that name too
                    self.globals[key] = spies[n]
                    self.rebound.append((key, value))
        for cell in self.cells:  # ... or holds it in a closure
            for n, f in self.real.items():
                if cell.cell_contents is f:
                    cell.cell_contents = spies[n]
                    self.recelled.append((cell, f))
        return self

    def __exit__(self, *exc) -> None:
        for n, f in self.real.items():
            setattr(os, n, f)
        for key, value in self.rebound:
            self.globals[key] = value
        for cell, value in self.recelled:
            cell.cell_contents = value
        if exc[0] is None:
            self.crash("after atomic_write returned")


def _answer_names(fn) -> tuple[dict | None, list]:
    """The globals of the answer's code and the closure cells of its functions (their nested ones too)."""
    import inspect

    f = inspect.unwrap(fn)
    while isinstance(f, functools.partial):
        f = inspect.unwrap(f.func)
    cells, seen, todo = [], set(), [f]
    while todo:
        g = todo.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        for cell in getattr(g, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            cells.append(cell)
            if callable(value) and hasattr(value, "__code__"):
                todo.append(value)
    return getattr(f, "__globals__", None), cells


def _judge_power_cuts(cut: _PowerCut, old: bytes | None, new: bytes, what: str) -> None:
    """Every state a power cut could leave is the old file or the new one, and once the write returned only
    the new one; the renamed file came from the target's directory."""
    expect(bool(cut.renamed_from), f"atomic_write ({what}): the file under the name was never replaced by a rename: write "
           "a temp file and rename it onto the path (os.replace): a copy or a direct write can be torn")
    expect(all(d == str(cut.dir.resolve()) for d in cut.renamed_from),
           f"atomic_write ({what}): the temp file was in {cut.renamed_from[-1]}, not in the target's directory "
           f"{cut.dir}: a rename is only atomic within one file system, so create the temp file next to the target")
    ok = {new} if old is None else {old, new}
    for when, states in cut.crashes:
        final = when.startswith("after")
        for kind, data in states:
            if kind == "durable" and data in ({new} if final else ok):
                continue
            if kind == "gone" and old is None and not final:
                continue  # a new file: before it is durable, no file is the old state
            if kind == "durable" and final and data == old:
                raise AssertionError(
                    f"atomic_write ({what}): after it returned, a power cut could still bring back the old file: the "
                    "rename is not durable until the directory is fsync'ed (os.open(dir, os.O_RDONLY), os.fsync, "
                    "os.close) after it")
            shown = ("no file at all" if kind == "gone" else
                     f"a file whose bytes were {kind} ({'unknown' if data is None else f'{len(data):,} bytes now'})"
                     if kind != "durable" else f"{len(data):,} bytes that are neither the old file nor the new one")
            if final and kind == "gone":
                raise AssertionError(
                    f"atomic_write ({what}): after it returned, a power cut could leave no file under the name: the "
                    "rename is not durable until the directory is fsync'ed (os.open(dir, os.O_RDONLY), os.fsync, "
                    "os.close) after it")
            hint = {"never synced": "fsync (or fdatasync) the temp file after its last write, and flush Python's "
                                    "buffer first, before the rename: a rename can reach the disk before the data",
                    "changed since its last sync": "fsync after the last write and flush (f.flush(), then "
                                                   "os.fsync(f.fileno())): fsync only makes durable what the OS has",
                    "gone": "never leave the name without a complete file (no moving the old file away)",
                    "durable": "write the temp file completely before it replaces the old one"}[kind]
            raise AssertionError(f"atomic_write ({what}): a power cut {when} could leave {cut.target.name} as "
                                 f"{shown}: {hint}")


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


# sizes and chunkings of the written file: empty chunks, one byte, many chunks, a large one
WRITE_SPACE = Space(chunks=ints(1, 6), size=one_of(1, 100, 4096, 70_000, 0), existing=flags(), empty=flags())


@register("07.atomic_write", reference=lambda: training_state.atomic_write, title="atomic checkpoint writer", timeout=120)
def check_atomic_write(fn) -> None:
    """Grade exercise ``07.atomic_write``: atomic checkpoint writer."""
    expect(callable(fn), f"atomic_write: expected a function, got {type(fn).__name__}")
    d = Path(tempfile.mkdtemp(prefix="memlab-07-"))
    answer_names = _answer_names(fn)
    try:
        target = d / "model.ckpt"
        old = b"OLD complete checkpoint " * 1000
        new = [b"NEW header|", b"x" * 50_000, b"y" * 50_000, b"|NEW end"]

        def write(chunks: list[bytes], what: str) -> None:
            before = target.read_bytes() if target.exists() else None
            with _PowerCut(target, answer_names) as cut:
                fn(target, iter(chunks))
            expect(target.read_bytes() == b"".join(chunks),
                   f"atomic_write ({what}): the file does not hold exactly the bytes written")
            _judge_power_cuts(cut, before, b"".join(chunks), what)
            leftovers = sorted(p.name for p in d.iterdir() if p != target)
            expect(not leftovers, f"atomic_write ({what}): files left next to the target after a successful write: "
                                  f"{leftovers}")

        # 1. a new file, then an overwrite: a power cut at every step leaves the old file or the new one
        write([old], "a new file")
        write(new, "overwriting a file, 4 chunks")

        def run(case) -> None:
            if not case.existing:
                target.unlink(missing_ok=True)
            else:
                target.write_bytes(old)
            body = bytes(range(256)) * (case.size // 256 + 1)
            body = body[: case.size]
            cut = [len(body) * i // case.chunks for i in range(case.chunks + 1)]
            chunks = [body[a:b] for a, b in zip(cut, cut[1:])]
            if case.empty:  # empty chunks (a zero-length tensor's bytes) first and in the middle
                chunks = [b"", *chunks[: len(chunks) // 2], b"", *chunks[len(chunks) // 2:]]
            write(chunks, f"{len(chunks)} chunk(s){' (some empty)' if case.empty else ''}, {case.size:,} bytes, "
                          f"{'over a file' if case.existing else 'a new file'}")

        differential(WRITE_SPACE, run, edges=[dict(chunks=2, size=100, existing=True, empty=True)], examples=6)
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


# The model below equals the measurement to the byte on the lab's five stacks (2-core x86_64 CPU, torch 2.13.0+cpu).
# The smallest terms a derivation could forget, on these cases: the 0-d tensors (the loss, backward's seed gradient,
# loss / k, the running sum, the last detached loss: 8 / 16 / 20 B at the start of the last backward, 4 B in
# optimizer.step()) and the previous tensor's `denom` still referenced inside AdamW's loop (4 x (c_fc bias) = 1,024 B
# at n_embd=64) are optional (the lecture does not show them); AdamW's 4-byte step counter per parameter tensor
# (112-160 B), SDPA's logsumexp (1-6 KiB), LayerNorm's mean/rstd (2-6 KiB), the token ids (16 x effective_batch x
# seq_len: 64 B-2 KiB), the causal-mask buffers (2-12 KiB) and the gradients that accumulation keeps alive (189-463
# KiB) count (tests/course/mutants/ch07.py: each of these FAILS). With accumulation and few tokens per micro-batch
# the real step can peak later than the model's two moments (the end of the last backward: the embedding's gradient
# made whole before it is added into .grad, up to ~4 V h bytes): the drawn configurations are graded against the model.
PREDICT_ALLOWED_BYTES = 0

_PREDICT_CASES = [
    (dict(block_size=32, n_layer=2, n_head=2, n_embd=64), Stack(micro_batch=4), 32),
    (dict(block_size=32, n_layer=2, n_head=2, n_embd=64), Stack(micro_batch=2, grad_accum=2), 32),
    (dict(block_size=64, n_layer=3, n_head=4, n_embd=32), Stack(micro_batch=1, grad_accum=4), 48),
    (dict(block_size=64, n_layer=3, n_head=4, n_embd=32), Stack(micro_batch=2, grad_accum=2), 64),
    (dict(block_size=32, n_layer=2, n_head=2, n_embd=64), Stack(micro_batch=2), 4),  # the optimizer step is the peak
]


def _peak_terms(model_fn, stack: Stack, seq_len: int) -> dict:
    """The model of the step, term by term: ``backward`` and ``optimizer`` (the two moments, from what the lecture
    and the lab's text teach), and the small terms a derivation may count or leave out: ``zero_d_backward`` (the 0-d
    losses and backward's 0-d seed gradient at the backward's start), ``zero_d_optimizer`` (the last 0-d loss in
    the step) and ``overlap`` (AdamW's previous ``denom`` still referenced: the optimizer moment with it)."""
    cfg = model_fn().config
    V, bs, L, a, h, r = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.mlp_ratio
    mb, ga, E, s, f = stack.micro_batch, stack.grad_accum, stack.effective_batch, seq_len, 4
    # parameter tensors in model.parameters() order (lm_head is tok_emb): embeddings, per block ln_1, c_attn,
    # c_proj, ln_2, c_fc, c_proj (weights then biases), then ln_f
    sizes = [V * h, bs * h] + L * [h, h, 3 * h * h, 3 * h, h * h, h, h, h, r * h * h, r * h, r * h * h, h] + [h, h]
    n = sum(sizes)
    weights = f * n + L * bs * bs  # + each block's bool causal-mask buffer
    grads = f * n
    adam = 2 * f * n + 4 * len(sizes)  # exp_avg, exp_avg_sq, a 0-d fp32 step counter per tensor
    ids = 2 * 8 * E * s  # x and y (int64), the whole effective batch, alive for the whole step
    # saved for backward, per block and token: 8 h-wide and 2 MLP-wide (r h) fp32 tensors, SDPA's logsumexp (one
    # per head), the two LayerNorms' mean and rstd; the head: logits, log-softmax, the logits' gradient (V each),
    # the embedding sum and ln_f's output (h each), the flattened targets; the positions (int64)
    per_block = mb * s * ((8 + 2 * r) * f * h + f * a + 4 * f)
    head = mb * s * (3 * f * V + 2 * f * h + 8) + 8 * s
    backward = weights + adam + ids + L * per_block + head + (grads if ga > 1 else 0)
    # AdamW(foreach=False): sqrt and the division make two tensors of the parameter's size
    optimizer = weights + grads + adam + ids + f * 2 * max(sizes)
    overlap = weights + grads + adam + ids + f * max(2 * k + (sizes[i - 1] if i else 0) for i, k in enumerate(sizes))
    # the 0-d tensors: backward's seed gradient, the loss (or loss / k, the running sum and the last detached loss)
    zero_d = 4 + (4 if ga == 1 else (8 + 4 if ga == 2 else 12 + 4))
    return dict(backward=backward, optimizer=optimizer, overlap=overlap, zero_d_backward=zero_d, zero_d_optimizer=4)


def predict_peak_bounds(model_fn, stack: Stack, seq_len: int) -> tuple[int, int]:
    """(lowest, highest) right prediction: the larger of the two moments without the small terms a derivation
    may leave out (the 0-d tensors, AdamW's previous ``denom``), and with all of them."""
    t = _peak_terms(model_fn, stack, seq_len)
    low = max(t["backward"], t["optimizer"])
    high = max(t["backward"] + t["zero_d_backward"], t["overlap"] + t["zero_d_optimizer"])
    return low, high


def predict_peak_formula(model_fn, stack: Stack, seq_len: int) -> int:
    """The reference: chapter 07's peak of a TinyGPT step (fp32, AdamW foreach=False, SDPA, no checkpointing),
    derived term by term from the config and the stack, every small term counted; nothing runs but the model's
    constructor (``model_fn()``: only its config is read). Bytes: the larger of the backward and optimizer-step
    moments. Equal to the measurement (MemoryTracker on the real trainer) when one of those two moments is the
    step's peak (the lab's five stacks); with accumulation and few tokens per micro-batch the real step can peak
    later, at the end of the last backward (the embedding's gradient made whole before it is added into .grad),
    which this model leaves out.
    """
    return predict_peak_bounds(model_fn, stack, seq_len)[1]


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


PREDICT_SPACE = Space(block_size=one_of(32, 16, 64), n_layer=ints(1, 4), n_head=one_of(2, 1, 4),
                      head_dim=one_of(16, 8, 32), vocab_size=one_of(256, 300, 512), mlp_ratio=one_of(4, 2, 3, 1),
                      micro_batch=ints(1, 4), grad_accum=ints(1, 4), seq_len=lambda c: ints(1, c.block_size))


def _predict_case(case) -> tuple[dict, Stack, int]:
    cfg = dict(block_size=case.block_size, n_layer=case.n_layer, n_head=case.n_head,
               n_embd=case.n_head * case.head_dim, vocab_size=case.vocab_size, mlp_ratio=case.mlp_ratio)
    return cfg, Stack(micro_batch=case.micro_batch, grad_accum=case.grad_accum), case.seq_len


@register("07.predict_peak", reference=lambda: predict_peak_formula,
          title="predict a stack's peak, then measure", timeout=240)
def check_predict_peak(fn) -> None:
    """Grade exercise ``07.predict_peak``: predict a stack's peak, then measure.

    The relation: the prediction lies between the lecture's model of the step without the small terms a derivation
    may count or leave out (the 0-d tensors, AdamW's previous ``denom``) and with all of them
    (:func:`predict_peak_bounds`: a band of 8-24 B when the backward is the peak, up to 4 x 4 h B more when the
    optimizer step is); every other term counts to the byte. On the lab's five stacks the model is also checked
    against the measurement (MemoryTracker on the real trainer), which it equals."""
    expect(callable(fn), f"predict_peak: expected a function, got {type(fn).__name__}")

    def predicted_for(cfg: dict, stack: Stack, seq_len: int, what: str) -> tuple[int, str]:
        model_fn = functools.partial(_tiny, cfg)
        where = (f"predict_peak(TinyGPT({', '.join(f'{k}={v}' for k, v in cfg.items())}), micro_batch={stack.micro_batch}, "
                 f"grad_accum={stack.grad_accum}, seq_len={seq_len}){what}")
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
        low, high = predict_peak_bounds(model_fn, stack, seq_len)
        t = _peak_terms(model_fn, stack, seq_len)
        n_tensors = len(list(model_fn().parameters()))
        moment = "the backward's start" if t["backward"] >= t["optimizer"] else "AdamW's largest denom"
        expect(low <= predicted <= high,
               f"{where}: predicted {predicted:,} bytes; the step's peak is {low:,}-{high:,} B ({moment}; "
               f"{predicted - (low if predicted < low else high):+,} B outside; the range is the 0-d tensors and AdamW's "
               f"previous denom, which you may count or not: every other term counts to the byte; AdamW's step "
               f"counters are {4 * n_tensors} B here, the token ids {16 * stack.effective_batch * seq_len:,} B). The "
               "peak is the larger of the last micro-batch's backward (as it starts) and the optimizer step of the "
               "steady state (a second step: AdamW's state exists)")
        return predicted, where

    def run(case) -> None:
        cfg, stack, seq_len = _predict_case(case)
        predicted_for(cfg, stack, seq_len, f" ({case})")

    # the lab's stacks first (the hand-picked edges), then any depth, heads and head size, vocabulary (the trainer's
    # data are bytes: 256 and more), MLP ratio, micro-batch, accumulation and length up to the block size
    lab = [dict(block_size=cfg["block_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                head_dim=cfg["n_embd"] // cfg["n_head"], vocab_size=256, mlp_ratio=4, micro_batch=stack.micro_batch,
                grad_accum=stack.grad_accum, seq_len=seq_len) for cfg, stack, seq_len in _PREDICT_CASES]
    differential(PREDICT_SPACE, run, edges=lab, examples=40)
    for cfg, stack, seq_len in _PREDICT_CASES:  # the lab's stacks: the model equals the measurement here
        measured = train.measure_stack_peak(functools.partial(_tiny, cfg), stack, seq_len)
        low, high = predict_peak_bounds(functools.partial(_tiny, cfg), stack, seq_len)
        expect(low <= measured <= high, f"internal: on {cfg}, {stack}, seq_len={seq_len}: measured {measured:,} B is "
                                        f"outside the model's {low:,}-{high:,} B")


__all__ = ["check_cheapest_stack", "check_back_off", "check_atomic_write", "check_predict_peak", "predict_peak_formula",
           "predict_peak_bounds"]
