"""The grading harness: hygiene probes that run on every exercise, and (in :mod:`.cases`) differential cases
drawn from an exercise's declared input space (DESIGN.md, "What a check must try").

A check (:mod:`memlab.course.checks`, one module per chapter) is plain code that calls the learner's answer and
compares it with memlab's reference. :func:`memlab.course.grading.check` runs it through :func:`run_exercise`,
which adds, for every exercise and with no per-exercise code:

Hygiene probes (a failing probe is a ``fail`` row: ``hygiene (<probe>): call #<n> of your function changed its
argument <name>...``):

- **inputs unchanged**: a function answer is wrapped; for every call the check makes (all of the first 64, then
  one in 16), each argument is pictured (:func:`snapshot`) before and compared after: a tensor's dtype, shape,
  strides, storage offset, ``requires_grad``, the bytes of its whole storage (read without a torch op, so a
  check's dispatch modes, trackers and allocator profiles see nothing) and its ``.grad``; a list's, tuple's or
  dict's contents; a module's parameters, buffers, gradients, training flag and hooks; an optimizer's groups,
  parameters and state; a dataclass's fields. Arguments the exercise changes on purpose are declared by the
  reference's parameter names: ``@register("04.adamw_update", ..., mutates=("param", "exp_avg", "exp_avg_sq"))``.
- **no shared result**: a tensor a call returns must not share memory with one an earlier call returned, unless
  it is a view of this call's own arguments (a buffer kept between calls that the caller then overwrites).
- **nothing kept alive**: after the check, no argument tensor or module and no returned tensor may still be held
  by a Python object (weak references, ``gc.collect()``): a global or class-level list or cache, a hook left
  installed. ``register(..., keeps=("name", ...))`` declares exceptions. (An object only torch's C++ side holds,
  an autograd graph torch keeps itself, is not counted.)
- **no class or global state**: the attributes of the learner's classes (the answer, and classes its code names),
  the globals its code names and its closure cells are pictured before the check and compared after it.
- **the grader's own code**: the functions, classes and function tables of the check's module and of the
  reference's module are pictured before the check and compared after each probed call and at its end
  (:mod:`.provenance`): an answer that rewrites what the check or the reference measures with fails.
- **memlab's reference, unavailable to the answer**: while a function answer runs (a class answer: while its
  check runs), the reference's ``__code__`` is a stand-in that notes a call from the learner's code
  (:func:`~.provenance.reference_swapped`); ``check()`` then gives no points.
- **a second run**: where state could hide (a class answer, or calls that took tensors or modules) the whole check
  runs again, fresh instances, :func:`current_pass` 1 (so :func:`differential` draws other cases and runs the
  edges in reverse order), probes off, and must pass again: a cache keyed by shape or the first call's dtype
  shows there. ``register(..., rerun=False)`` skips it.

A class answer (or an ``autograd.Function``, a Triton kernel) is passed to the check as it is; the class and
global probes and the second run still apply. While an exercise runs, the objects that existed before are frozen
out of the garbage collector (``gc.freeze``), so a check's ``gc.collect()`` costs milliseconds.

Differential cases, for a check author (from ``memlab.course.checks``, defined in :mod:`.cases`)::

    SPACE = Space(n=ints(1, 300), chunk=lambda c: ints(1, c.n + 8),
                  dtype=one_of(torch.float32, torch.float16, torch.bfloat16, torch.float64),
                  layout=layouts(), decay=flags())

    def check_x(fn):
        def run(case):                      # one case: build inputs, call fn and the reference, compare
            x = make_tensor((case.n,), case.dtype, case.layout, case.seed)
            expect_equal(f"fn({case})", fn(x.clone(), case.chunk), reference(x, case.chunk))
        differential(SPACE, run, edges=[dict(n=9, chunk=1, dtype=torch.float32, layout="contiguous",
                                             decay=False)], examples=20)

- ``Space(**fields, where=None)``: a field is :func:`~.cases.ints`, :func:`~.cases.floats` (``log=True`` for
  scales), :func:`~.cases.one_of` (dtypes, names, configs; shrinks toward the first), :func:`~.cases.flags`,
  :func:`~.cases.layouts` (contiguous, transposed, strided, offset, channels_last), any hypothesis strategy, a
  constant, or a function of the fields before it. Every :class:`~.cases.Case` also gets ``seed``.
- ``differential(space, run, *, edges=(), examples=20, seed=0)`` runs ``run`` on each edge (dicts: keep the
  check's hand-picked cases here), on a sweep that takes every option of each small field and every pair of
  options of two small fields (at most ``SWEEP_ROWS`` cases), then on ``examples`` cases hypothesis draws with a
  fixed seed and no database (the same on every machine); the first failure is shrunk within ``SHRINK_BUDGET``
  runs and the smallest case's AssertionError is raised (so name ``case`` in every message). Returns the number
  of cases run. ``failures()`` says which part (edge, sweep, drawn) caught the last failure of each exercise;
  inside ``drawn_only()`` the edges are skipped (tests/course/test_mutants.py shows the space alone catches a
  constants or space mutant).
- ``expect_prediction(where, got, model, measure, tolerance)``: a predict-then-measure exercise's relation on a
  drawn case: within ``tolerance`` of memlab's model or of the measurement (measured only when needed).
- ``make_tensor(shape, dtype, layout, seed, scale=1.0, low=0, high=16, device="cpu")``: reproducible values.
- Relations stay the check's: ``expect_equal`` (exact, exact types), ``expect_tensor_close`` (a tolerance no
  wider than the smallest plausible mistake), ``torch.equal`` for bitwise.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from memlab.course.grading.cases import running
from memlab.course.grading.provenance import (
    grader_modules, grader_state, grader_state_changed, mark_boundary, reference_functions, reference_swapped,
)
from memlab.course.grading.registry import is_learner_file
from memlab.course.grading.snapshots import difference, learner_classes, snapshot

__all__ = ["run_exercise", "HygieneError", "snapshot", "difference"]  # the pictures come from .snapshots

class HygieneError(AssertionError):
    """A hygiene probe failed (an AssertionError: the row is ``fail``)."""


# ----------------------------------------------------------------------------- the learner's state
def _codes(obj: Any) -> list[types.CodeType]:
    """The code objects of a function (unwrapped), or of the methods a class defines (nested ones included)."""
    out: list[types.CodeType] = []

    def add(f: Any) -> None:
        for g in (f, getattr(f, "__func__", None), getattr(f, "fget", None), getattr(f, "__wrapped__", None)):
            code = getattr(g, "__code__", None)
            if isinstance(code, types.CodeType) and code not in out and is_learner_file(code.co_filename):
                stack = [code]
                while stack:
                    c = stack.pop()
                    out.append(c)
                    stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]

    if isinstance(obj, type):
        for klass in learner_classes(obj):
            for v in vars(klass).values():
                add(v)
    else:
        while isinstance(obj, functools.partial):
            obj = obj.func
        add(obj)
        add(getattr(type(obj), "__call__", None))
    return out


def _class_snap(cls: type) -> dict[str, Any]:
    skip = {"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__annotations__", "_abc_impl",
            "__parameters__", "__orig_bases__", "__slotnames__"}  # __slotnames__: copyreg's cache (a deepcopy sets it)
    # a function a library put on the class is the library's (torch.optim.Optimizer wraps a subclass's step() in
    # a profiling hook the first time one is made): not the learner's state
    return {k: snapshot(v, 4) for k, v in vars(cls).items() if k not in skip and not
            (isinstance(v, types.FunctionType) and not is_learner_file(v.__code__.co_filename))}


_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial, type)


def _state_picture(value: Any) -> Any:
    """A global's or a closure cell's picture: data by value; a function or class is not data (a check may
    instrument a name the answer calls, as 07.atomic_write observes os.replace imported by name)."""
    return ("callable",) if isinstance(value, _CALLABLES) else snapshot(value, 4)


def _state_snapshot(obj: Any) -> dict[str, Any]:
    """The class attributes of the learner's classes and the globals (and closure cells) the learner's code
    names, each pictured by :func:`snapshot`."""
    out: dict[str, Any] = {}
    classes: list[type] = list(learner_classes(obj)) if isinstance(obj, type) else []
    fn = obj
    while isinstance(fn, functools.partial):
        fn = fn.func
    fns = [fn] if not isinstance(obj, type) else [getattr(v, "__func__", v) for c in classes for v in vars(c).values()]
    for f in fns:
        f = getattr(f, "__wrapped__", f)
        g = getattr(f, "__globals__", None)
        code = getattr(f, "__code__", None)
        if not isinstance(g, dict) or not isinstance(code, types.CodeType) or not is_learner_file(code.co_filename):
            continue
        for c in _codes(f):
            for name in c.co_names:
                if name in g:
                    value = g[name]
                    if isinstance(value, type) and value not in classes and learner_classes(value):
                        classes += learner_classes(value)
                    out[f"global {name}"] = _state_picture(value)
        for i, cell in enumerate(getattr(f, "__closure__", None) or ()):
            try:
                out[f"closure variable {code.co_freevars[i]} of {f.__qualname__}"] = _state_picture(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    for klass in classes:
        for k, v in _class_snap(klass).items():
            out[f"class attribute {klass.__qualname__}.{k}"] = v
    return out


def _state_changed(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    for key, b in before.items():
        if key not in after:
            return f"{key} was deleted"
        d = difference(b, after[key], "")
        if d:
            return f"{key}{d}"
    for key in after:
        if key not in before and key.startswith("class attribute"):
            return f"{key} was added"
    return None


# ----------------------------------------------------------------------------- the wrapped answer
def _signature_names(ex: Any) -> inspect.Signature | None:
    try:
        ref = ex.reference() if ex.reference is not None else None
        return inspect.signature(ref) if callable(ref) and not isinstance(ref, type) else None
    except (TypeError, ValueError):
        return None


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _flat(x: Any, depth: int = 0) -> Iterator[Any]:
    """Tensors and modules in ``x`` (lists, tuples, dicts, two levels deep)."""
    if _is_tensor(x):
        yield x
    elif type(x).__module__.startswith("torch.nn") or _is_module(x):
        yield x
    elif depth < 2 and isinstance(x, (list, tuple)):
        for v in x:
            yield from _flat(v, depth + 1)
    elif depth < 2 and isinstance(x, dict):
        for v in x.values():
            yield from _flat(v, depth + 1)


def _is_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def _data_ptr(t: Any) -> int:
    try:
        if t.device.type == "meta" or type(t).__name__ == "FakeTensor":
            return 0
        st = t.untyped_storage()
        return st.data_ptr() if st.nbytes() else 0
    except Exception:  # noqa: BLE001
        return 0


@dataclass
class _Session:
    """One run of an exercise's checks on a wrapped answer: the calls, what they returned, weak references."""

    ex: Any
    mutates: frozenset[str]
    keeps: frozenset[str]
    signature: inspect.Signature | None
    probes: bool = True
    roots: dict[int, str] = field(default_factory=dict)  # id of the answer's globals -> a name for it
    calls: int = 0
    tensors_seen: bool = False  # an argument held tensors or modules (state a second run could expose)
    results: list[tuple[int, int, Any]] = field(default_factory=list)  # (call, data_ptr, weakref to the storage)
    alive: list[tuple[str, Any]] = field(default_factory=list)  # (what, weakref)
    answer: Any = None  # the learner's object, for the state it names
    state: dict[str, Any] | None = None  # its class and global state before the check
    reference: dict[Any, str] = field(default_factory=dict)  # the reference's functions, swapped while it runs
    grader: dict[str, Any] | None = None  # the check's and the reference's modules before the check
    grader_mods: list[Any] = field(default_factory=list)  # those modules

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # the answer itself runs here, memlab's reference made observable (provenance.reference_swapped): a
        # reference called from this frame is the answer (a callable object whose __call__ is the reference)
        with reference_swapped(self.reference):
            return fn(*args, **kwargs)

    def grader_changed(self, where: str) -> None:
        """HygieneError when the answer changed the check's or the reference's code (``where``: which call)."""
        if self.grader is None:
            return
        changed = grader_state_changed(self.grader, grader_state(self.grader_mods))
        if changed:
            raise HygieneError(f"hygiene (the grader's own code): {where} changed {changed}: an answer must not "
                               f"change the check or memlab's reference (the check measures with them)")

    def _bind(self, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
        if self.signature is not None:
            try:
                bound = self.signature.bind(*args, **kwargs)
                return list(bound.arguments.items())
            except TypeError:
                pass
        return [(f"argument {i + 1}", a) for i, a in enumerate(args)] + list(kwargs.items())

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        n = self.calls
        named = self._bind(args, kwargs)
        self.tensors_seen = self.tensors_seen or any(True for _, v in named for _ in _flat(v))
        # every call while a check's first 64 calls last, then one in 16 (a check that asks thousands of times)
        if not self.probes or not (n <= 64 or n % 16 == 0):
            return self._run(fn, args, kwargs)
        before = {name: snapshot(value) for name, value in named if name not in self.mutates}
        result = self._run(fn, args, kwargs)
        where = f"call #{n} of your {self._what()}"
        self.grader_changed(where)
        for name, value in named:
            if name in before:
                d = difference(before[name], snapshot(value), name)
                if d:
                    raise HygieneError(
                        f"hygiene (inputs unchanged): {where} changed its argument {d}; leave the caller's inputs as "
                        f"they were (work on a copy: .clone(), list(...), copy.deepcopy)")
        self._results(n, named, result, where)
        if self.state is not None:  # state that changes across calls shows at the call that changed it
            changed = _state_changed(self.state, _state_snapshot(self.answer))
            if changed:
                raise HygieneError(f"hygiene (no class or global state): {where} changed {changed}: keep state on the "
                                   f"instance (self) or return it; an answer must give the same result however many "
                                   f"times and in whichever order it is called")
        for name, value in named:
            if name not in self.keeps:
                for i, obj in enumerate(_flat(value)):
                    self._watch(f"the {'tensor' if _is_tensor(obj) else type(obj).__name__} passed as {name}"
                                f"{f' (item {i})' if not (_is_tensor(value) or _is_module(value)) else ''} in call #{n}", obj)
        return result

    def _what(self) -> str:
        return "function"

    def _watch(self, what: str, obj: Any) -> None:
        if type(obj).__name__ == "FakeTensor" or (_is_tensor(obj) and obj.device.type == "meta"):
            return
        try:
            self.alive.append((what, weakref.ref(obj)))
        except TypeError:
            pass

    def _results(self, n: int, named: list[tuple[str, Any]], result: Any, where: str) -> None:
        own = {_data_ptr(t) for _, v in named for t in _flat(v) if _is_tensor(t)}
        own |= {_data_ptr(p) for _, v in named for m in _flat(v) if _is_module(m) for p in list(m.parameters()) + list(m.buffers())}
        for i, t in enumerate(x for x in _flat(result) if _is_tensor(x)):
            ptr = _data_ptr(t)
            self._watch(f"the tensor returned by call #{n}" + (f" (item {i})" if not _is_tensor(result) else ""), t)
            if not ptr or ptr in own:
                continue
            for m, p, ref in self.results:
                st = ref()
                if p == ptr and st is not None and m != n:
                    raise HygieneError(
                        f"hygiene (no shared result): {where} returned a tensor in the same memory as the one call "
                        f"#{m} returned: a cached tensor (functools.lru_cache, a buffer kept between calls) that the "
                        f"caller may overwrite; return a new tensor from each call")
            try:
                self.results.append((n, ptr, weakref.ref(t.untyped_storage())))
            except TypeError:
                pass

    def leaks(self) -> str | None:
        if all(ref() is None for _, ref in self.alive):
            return None  # freed by reference counting: no collection needed
        gc.collect()  # the young objects only: what existed before the check is frozen
        alive = [(what, ref()) for what, ref in self.alive]
        alive = [(what, obj) for what, obj in alive if obj is not None]
        if not alive:
            return None
        found = _held_from(dict(self.roots), {id(obj): what for what, obj in alive})
        del alive
        if found:
            what, anchor = found
            return (f"hygiene (nothing kept alive): after the check, {what} is still alive, held from {anchor}: your "
                    f"code keeps a reference to it (a global or class-level list or cache, a hook left installed, a "
                    f"tensor stored on an object that outlives the call)")
        return None


def _held_from(roots: dict[int, str], targets: dict[int, str], depth: int = 6, budget: int = 200_000) -> tuple[str, str] | None:
    """(what, where) for the first of ``targets`` (ids) reachable from the answer's globals (``roots``: ids of
    namespaces) or the learner's classes, following references down ``depth`` levels (at most ``budget`` objects);
    None when none is: an object only torch's C++ side holds (an autograd graph torch keeps itself) is not the
    answer's doing."""
    namespaces = [(ns, name) for ns, name in ((_by_id(i), n) for i, n in roots.items()) if ns is not None]
    seen: set[int] = {id(ns) for ns, _ in namespaces}
    for ns, name in namespaces:
        for key, value in list(ns.items()):
            if isinstance(value, (types.ModuleType, types.BuiltinFunctionType)) or (
                    isinstance(value, types.FunctionType) and not is_learner_file(value.__code__.co_filename)):
                continue  # a module or a library's function: not where the learner keeps data
            where = (f"the class {value.__qualname__}" if isinstance(value, type) else f"the global {key!r} of {name}")
            level, steps = [value], 0
            while level and steps < depth and len(seen) < budget:
                nxt = []
                for obj in level:
                    if id(obj) in targets:
                        return targets[id(obj)], where
                    if id(obj) in seen or isinstance(obj, (types.ModuleType, type(sys))):
                        continue
                    seen.add(id(obj))
                    if isinstance(obj, type) and not learner_classes(obj):
                        continue  # a library class: its attributes are not the learner's state
                    nxt.extend(gc.get_referents(obj))
                level, steps = nxt, steps + 1
    return None


_NAMESPACES: dict[int, Any] = {}
mark_boundary(_Session._run.__code__)


def _by_id(i: int) -> Any:
    return _NAMESPACES.get(i)


def _wrap(obj: Any, session: _Session) -> Any:
    """``obj`` with every call going through ``session`` (plain functions and callable objects); a class,
    a Triton kernel or anything else is returned as it is."""
    if isinstance(obj, type) or not callable(obj):
        return obj
    mod = str(getattr(type(obj), "__module__", ""))
    if not isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)) \
            and (mod.startswith("triton") or mod.startswith("torch")):
        return obj

    def answer(*args: Any, **kwargs: Any) -> Any:
        return session.call(obj, args, kwargs)

    try:
        functools.update_wrapper(answer, obj)
    except (AttributeError, TypeError):
        pass
    return answer


# ----------------------------------------------------------------------------- running an exercise
def _answer_roots(obj: Any) -> dict[int, str]:
    """The globals dicts of the answer's code (a notebook's namespace, a script's module), by id."""
    fns = [getattr(v, "__func__", v) for c in learner_classes(obj) for v in vars(c).values()] if isinstance(obj, type) else [obj]
    out = {}
    for f in fns:
        while isinstance(f, functools.partial):
            f = f.func
        g = getattr(getattr(f, "__wrapped__", f), "__globals__", None)
        if isinstance(g, dict):
            out[id(g)] = "your notebook" if g.get("__name__") == "__main__" else str(g.get("__name__", "your module"))
            _NAMESPACES[id(g)] = g
    return out


def _names_declared(ex: Any, signature: inspect.Signature | None) -> None:
    declared = set(getattr(ex, "mutates", ())) | set(getattr(ex, "keeps", ()))
    if declared and signature is not None:
        unknown = declared - set(signature.parameters)
        if unknown:
            raise ValueError(f"{ex.id}: mutates/keeps name {sorted(unknown)}, not parameters of the reference "
                             f"({', '.join(signature.parameters)})")


def _one_pass(ex: Any, obj: Any, p: int) -> _Session:
    signature = _signature_names(ex)
    _names_declared(ex, signature)
    session = _Session(ex, frozenset(getattr(ex, "mutates", ())), frozenset(getattr(ex, "keeps", ())), signature,
                       probes=p == 0, roots=_answer_roots(obj), answer=obj,
                       state=_state_snapshot(obj) if p == 0 and not isinstance(obj, type) else None)
    session.reference = reference_functions(ex)
    session.grader_mods = grader_modules(ex, session.reference)
    session.grader = grader_state(session.grader_mods)
    answer = _wrap(obj, session)
    # a class answer has no call of its own to swap the reference around: swapped for the whole check (a call
    # the check makes counts not, one from the learner's methods or a thread they start does)
    with running(ex.id, p), (reference_swapped(session.reference) if answer is obj else contextlib.nullcontext()):
        for check_fn in ex.checks:
            check_fn(answer)
    session.grader_changed("your answer, during the check,")
    return session


def run_exercise(ex: Any, obj: Any) -> None:
    """Run every check of exercise ``ex`` on the learner's ``obj`` with the hygiene probes (module
    docstring); raises what a check raises, or :class:`HygieneError`.

    While it runs, every object that existed before is frozen out of the garbage collector
    (``gc.freeze``): a ``gc.collect()`` in a check (or a probe) then scans only what the check made,
    milliseconds instead of a scan of the whole heap of torch and the notebook."""
    frozen = not gc.isenabled() or gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    try:
        _run_exercise(ex, obj)
    finally:
        if frozen:
            gc.unfreeze()


def _run_exercise(ex: Any, obj: Any) -> None:
    state = _state_snapshot(obj)
    session = _one_pass(ex, obj, 0)
    leak = session.leaks()
    # a second run where state could hide: a class (instances), or calls that took tensors or modules; an
    # answer called on plain values only (a config, numbers) was already called on several in one run
    again = getattr(ex, "rerun", True) and (isinstance(obj, type) or session.tensors_seen or not callable(obj))
    del session
    if leak:
        raise HygieneError(leak)
    changed = _state_changed(state, _state_snapshot(obj))
    if changed:
        raise HygieneError(f"hygiene (no class or global state): during the check, {changed}: keep state on the "
                           f"instance (self) or return it; an answer must give the same result however many times "
                           f"and in whichever order it is called")
    if again:
        try:
            _one_pass(ex, obj, 1)
        except AssertionError as exc:
            raise HygieneError(f"hygiene (a second run): the check passed once, then failed when run again on fresh "
                               f"instances with other random cases (state kept across calls or instances?): "
                               f"{exc}") from None
