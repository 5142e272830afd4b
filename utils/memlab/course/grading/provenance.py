"""Whose code an answer runs: memlab's reference passed off as the learner's, found by what the answer computes
with rather than by its name (issue 41).

Three looks, each covering what the others miss (README, "Threat model", says what they still cannot promise):

- **What the answer wraps** (:func:`wrapped_reference`, before the check): the answer is unwrapped (partials,
  bound methods, ``staticmethod``/``classmethod``, ``__wrapped__``, a callable object's ``__call__``, a class's
  methods) and followed into its closure cells, defaults and the globals its code names (lists, tuples, dicts
  and instances of the learner's classes too, a few levels deep); every code object reached is compared with the
  reference's: the same object (a function cloned with ``types.FunctionType(ref.__code__, ...)``), or the same
  bytecode, names and constants (:func:`~.verify.same_code`) outside the learner's files. A memlab module the
  answer's code names, with the reference function among the attributes the code names, counts too.
- **The reference unavailable while the answer runs** (:func:`reference_swapped`, around each call of a function
  answer by the harness): the reference function's ``__code__`` is swapped for a stand-in that notes the call and
  then runs memlab's code. Whatever route reaches the reference's function object (a callable object, a worker
  thread, tracing switched off with ``sys.settrace(None)``, a clone made during the call from
  ``ref.__code__``) runs the stand-in; the call counts when the first frame above it that is not a library's is
  the learner's, the harness's own call of the answer, or none (a thread the answer started), not when it is
  memlab's (a check's callback, a helper of memlab's that the answer may use).
- **The grader's own state** (:func:`grader_state`): the functions, classes and function tables of the check's
  module and of the reference's module, pictured before an answer call and compared after it (an answer that
  rewrites the check's ``forward`` or its table of ops before the reference runs).
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import types
from contextlib import contextmanager
from typing import Any, Iterator

from memlab.course.grading.registry import MEMLAB_DIR, STAND_IN_FILE, is_learner_file, is_library_file
from memlab.course.grading.verify import same_code

__all__ = ["reference_functions", "reference_codes", "wrapped_reference", "reference_swapped", "reference_hits",
           "reset_hits", "grader_modules", "grader_state", "grader_state_changed", "mark_boundary"]

_HOOK = "__memlab_reference_call__"  # the name the stand-in code calls, set in the reference's globals meanwhile
_HITS: list[str] = []  # the reference parts the answer ran, in this process, since reset_hits()
_LOCK = threading.Lock()


# ----------------------------------------------------------------------------- the reference's code
def _name(f: Any) -> str:
    return f"{getattr(f, '__module__', None) or 'memlab'}.{getattr(f, '__qualname__', type(f).__name__)}"


def _unwrapped(f: Any) -> list[Any]:
    """``f`` and what it wraps: ``__func__``, ``fget``/``fset``, the ``__wrapped__`` chain, a partial's func."""
    out, todo = [], [f]
    while todo:
        g = todo.pop()
        if g is None or any(g is o for o in out) or len(out) > 32:
            continue
        out.append(g)
        todo += [getattr(g, "__func__", None), getattr(g, "fget", None), getattr(g, "fset", None),
                 getattr(g, "__wrapped__", None), g.func if isinstance(g, functools.partial) else None]
    return out


def reference_functions(ex: Any) -> dict[types.FunctionType, str]:
    """The Python functions of exercise ``ex``'s reference (the function and what it wraps; a class's methods),
    each with a name for the message."""
    if ex.reference is None:
        return {}
    try:
        ref = ex.reference()
    except Exception:  # noqa: BLE001 - a reference that needs an optional extra
        return {}
    parts = [(v, f"{_name(ref)}.{k}") for k, v in vars(ref).items()] if isinstance(ref, type) else [(ref, _name(ref))]
    out: dict[types.FunctionType, str] = {}
    for value, where in parts:
        for f in _unwrapped(value):
            if isinstance(f, types.FunctionType) and _is_memlab_file(f.__code__.co_filename):
                out.setdefault(f, where)
    return out


def _is_memlab_file(filename: str) -> bool:
    """memlab's own source: a library's wrapper around a reference (``torch.no_grad()``'s ``decorate_context``, one
    code object for every function it decorates) is not the reference's code, or a learner's ``@torch.no_grad()``
    method would read as memlab's."""
    return os.path.realpath(filename).startswith(MEMLAB_DIR + os.sep)


def reference_codes(ex: Any) -> dict[types.CodeType, str]:
    """Every code object of the reference's functions, nested ones (lambdas, inner functions) included."""
    out: dict[types.CodeType, str] = {}
    for f, where in reference_functions(ex).items():
        stack = [f.__code__]
        while stack:
            c = stack.pop()
            if c not in out:
                out[c] = where
                stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return out


# ----------------------------------------------------------------------------- what the answer wraps
def _is_library_object(x: Any) -> bool:
    """A module's class or function that is not the learner's (a library's or memlab's): not walked into."""
    mod = sys.modules.get(str(getattr(x, "__module__", "") or ""))
    file = getattr(mod, "__file__", None)
    return str(getattr(x, "__module__", "")).startswith("memlab") or (isinstance(file, str) and not is_learner_file(file))


def _matches(code: types.CodeType, codes: dict[types.CodeType, str], funcs: dict) -> str | None:
    """The reference part ``code`` is: one of its code objects (nested ones too), or, outside the learner's files,
    a copy of a reference function's own code (same name, bytecode, names and constants: ``code.replace(...)``);
    not a nested lambda that merely compiles alike."""
    if code in codes:
        return codes[code]
    if is_learner_file(code.co_filename):
        return None  # the learner's own code: an honest answer may compile to memlab's bytecode
    return next((where for f, where in funcs.items()
                 if f.__code__.co_qualname == code.co_qualname and same_code(code, f.__code__)), None)


def wrapped_reference(obj: Any, ex: Any, *, depth: int = 5, budget: int = 5000) -> str | None:
    """The reference part (its qualified name) that the answer ``obj`` wraps or names, or None (module
    docstring, first look). Never raises."""
    try:
        codes = reference_codes(ex)
        funcs = reference_functions(ex)
        if not codes:
            return None
        return _walk(obj, codes, funcs, depth, budget)
    except Exception:  # noqa: BLE001 - a hostile object must not break the row
        return None


def _walk(obj: Any, codes: dict, funcs: dict, depth: int, budget: int) -> str | None:
    seen: set[int] = set()
    level = [obj]
    for _ in range(depth):
        nxt: list[Any] = []
        for x in level:
            if id(x) in seen or len(seen) > budget:
                continue
            seen.add(id(x))
            if isinstance(x, types.FunctionType) and x in funcs:
                return funcs[x]
            if isinstance(x, types.CodeType):
                hit = _matches(x, codes, funcs)
                if hit:
                    return hit
                nxt += [k for k in x.co_consts if isinstance(k, types.CodeType)]
                continue
            nxt += _inside(x, funcs)
            hit = next((h for h in nxt if type(h) is _Named), None)
            if hit:
                return str(hit)
        level = [x for x in nxt if type(x) is not _Named]
    return None


class _Named(str):
    """A reference function that the answer's code names through a memlab module (its qualified name)."""


def _inside(x: Any, funcs: dict) -> list[Any]:
    """What ``x`` holds that could run: wrapped callables, code, closure cells, defaults, the globals its code
    names, containers' items, an instance's class and attributes (a :class:`_Named`: a reference named through a
    module)."""
    out: list[Any] = []
    if isinstance(x, functools.partial):
        out += [x.func, *x.args, *x.keywords.values()]
    elif isinstance(x, (staticmethod, classmethod)):
        out.append(x.__func__)
    elif isinstance(x, property):
        out += [x.fget, x.fset, x.fdel]
    elif isinstance(x, types.MethodType):
        out += [x.__func__, x.__self__]
    elif isinstance(x, types.FunctionType):
        out += [x.__code__, getattr(x, "__wrapped__", None), *(x.__defaults__ or ()), *(x.__kwdefaults__ or {}).values()]
        if is_learner_file(x.__code__.co_filename):  # a library's or memlab's function: its code alone
            for cell in x.__closure__ or ():
                try:
                    out.append(cell.cell_contents)
                except ValueError:
                    pass
            out += _named_globals(x, funcs)
    elif isinstance(x, type):
        if not _is_library_object(x):
            out += [v for k, v in vars(x).items() if k not in ("__dict__", "__weakref__", "__doc__", "__module__")]
            out += [b for b in x.__bases__ if b is not object]
    elif type(x) in (list, tuple, set, frozenset):
        out += list(x)[:256]
    elif type(x) is dict:
        out += list(x.values())[:256]
    elif isinstance(x, types.ModuleType) or x is None or type(x) in (int, float, str, bytes, bool):
        pass
    elif not _is_library_object(type(x)):  # an instance of the learner's class (a callable object)
        out.append(type(x))
        d = getattr(x, "__dict__", None)
        if isinstance(d, dict):
            out += list(d.values())[:256]
    return [o for o in out if o is not None]


def _named_globals(f: types.FunctionType, funcs: dict) -> list[Any]:
    """The globals ``f``'s code (nested code too) names; for a memlab module among them, the reference's function
    when the code also names it as that module's attribute (``accounting.model_state_bytes(...)``), as its name."""
    g = f.__globals__
    co_names: set[str] = set()
    stack = [f.__code__]
    while stack:
        c = stack.pop()
        co_names |= set(c.co_names)
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    out: list[Any] = []
    for n in co_names:
        if n not in g:
            continue
        v = g[n]
        if isinstance(v, types.ModuleType):
            if str(v.__name__).startswith("memlab"):
                attrs = [vars(v).get(a) for a in co_names]  # no module __getattr__ (a lazy import) is run
                out += [_Named(funcs[a]) for a in attrs if isinstance(a, types.FunctionType) and a in funcs]
            continue
        out.append(v)
    return out


# ----------------------------------------------------------------------------- the reference unavailable
def reset_hits() -> None:
    """Forget the reference calls noted so far (the grader calls it before each exercise)."""
    with _LOCK:
        _HITS.clear()


def reference_hits() -> list[str]:
    """The reference parts the learner's code ran while :func:`reference_swapped` was on, since :func:`reset_hits`."""
    with _LOCK:
        return list(_HITS)


# a reference function (id) -> (the function, key, its stand-in): one key per function object, not per code (two
# functions a factory made share one code object with other closures)
_STAND_IN: dict[int, tuple[types.FunctionType, int, types.CodeType]] = {}
_REAL: dict[int, tuple[types.FunctionType, str]] = {}  # key -> (memlab's function as it is, its name)
_BOUNDARY: set[types.CodeType] = set()  # the harness's frames that call the answer itself


def mark_boundary(code: types.CodeType) -> None:
    """Declare ``code`` (the harness's call of the answer) as the answer's own frame: the reference called
    right from it is the answer itself (a callable object whose ``__call__`` is the reference)."""
    _BOUNDARY.add(code)


def _stand_in(f: types.FunctionType, code: types.CodeType) -> tuple[int, types.CodeType]:
    """(key, a code object with ``code``'s number of free variables that calls the hook with key, args, kwargs)
    for the function ``f`` whose code is ``code``."""
    known = _STAND_IN.get(id(f))
    if known is None or known[0] is not f or known[2].co_flags & 0x20 != code.co_flags & 0x20 \
            or len(known[2].co_freevars) != len(code.co_freevars):
        key = len(_REAL) + 1
        free = [f"_f{i}" for i in range(len(code.co_freevars))]
        call = f"{_HOOK}({key}, args, kwargs)"
        body = ("    def stand_in(*args, **kwargs):\n"
                + (f"        {', '.join(free)}\n" if free else "")
                + (f"        yield from {call}\n" if code.co_flags & 0x20 else f"        return {call}\n"))
        src = "def outer():\n" + "".join(f"    {v} = None\n" for v in free) + body + "    return stand_in\n"
        ns: dict[str, Any] = {}
        exec(compile(src, _STAND_IN_FILE, "exec"), ns)  # noqa: S102 - our own fixed source
        _STAND_IN[id(f)] = (f, key, ns["outer"]().__code__)
        _REAL[key] = (f, "")  # the key is taken
    _, key, stand_in = _STAND_IN[id(f)]
    return key, stand_in


_STAND_IN_FILE = STAND_IN_FILE


def _counts(frame: Any) -> bool:
    """Whether the call whose caller is ``frame`` is the learner's doing (module docstring, second look)."""
    f = frame
    while f is not None:
        code = f.f_code
        if code in _BOUNDARY:
            return True
        filename = code.co_filename
        if is_learner_file(filename) and filename != _STAND_IN_FILE:
            return True
        if not (is_library_file(filename) or filename.startswith("<frozen") or filename == _STAND_IN_FILE):
            return False  # memlab's own code (a check's callback, a helper) made the call
        f = f.f_back
    return True  # only library frames: a thread the answer started


def _hook(key: int, args: tuple, kwargs: dict) -> Any:
    real, where = _REAL[key]
    if _counts(sys._getframe(1).f_back):
        with _LOCK:
            if where not in _HITS:
                _HITS.append(where)
    return real(*args, **kwargs)


@contextmanager
def reference_swapped(functions: dict[types.FunctionType, str]) -> Iterator[None]:
    """While inside, each of ``functions`` runs a stand-in that notes a call the learner's code made and then
    runs memlab's code (module docstring, second look). Nested uses leave an outer swap as it is."""
    swapped: list[tuple[types.FunctionType, types.CodeType, dict, bool, Any]] = []
    try:
        for f, where in functions.items():
            code = f.__code__
            if code.co_filename == _STAND_IN_FILE:
                continue  # already swapped by an outer call
            key, stand_in = _stand_in(f, code)
            real = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
            real.__kwdefaults__, real.__qualname__ = f.__kwdefaults__, f.__qualname__
            _REAL[key] = (real, where)
            g = f.__globals__
            had, old = _HOOK in g, g.get(_HOOK)
            g[_HOOK] = _hook
            f.__code__ = stand_in
            swapped.append((f, code, g, had, old))
        yield
    finally:
        for f, code, g, had, old in reversed(swapped):
            f.__code__ = code
            if had:
                g[_HOOK] = old
            else:
                g.pop(_HOOK, None)


# ----------------------------------------------------------------------------- the grader's own state
def grader_modules(ex: Any, functions: dict | None = None) -> list[types.ModuleType]:
    """The modules of the exercise's checks and of its reference's ``functions`` (default:
    :func:`reference_functions`), memlab's by file: what :func:`grader_state` pictures."""
    mods: list[types.ModuleType] = []
    objs = list(ex.checks) + list(reference_functions(ex) if functions is None else functions)
    for f in objs:
        m = sys.modules.get(str(getattr(f, "__module__", "") or ""))
        if isinstance(m, types.ModuleType) and m not in mods and str(getattr(m, "__file__", "")).startswith(MEMLAB_DIR):
            mods.append(m)
    return mods


_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial, type)


def _code_of(v: Any) -> Any:
    # the innermost function: a library may wrap a class's method once (torch.optim.Optimizer wraps a subclass's
    # step() in a profiling hook the first time one is made, functools.wraps keeps the original as __wrapped__)
    f = getattr(v, "__func__", v)
    for _ in range(8):
        inner = getattr(f, "__wrapped__", None)
        if inner is None:
            break
        f = inner
    return (id(f), id(getattr(f, "__code__", None)), id(getattr(f, "__defaults__", None)))


def _picture(value: Any, home: str) -> Any:
    """A function by its identity and code; a class of the module by its methods; a dict, list or tuple by its
    callables (a table of ops); anything else (data, caches a check fills) is not pictured."""
    if isinstance(value, (types.FunctionType, staticmethod, classmethod)):
        return _code_of(value)
    if isinstance(value, type) and getattr(value, "__module__", None) == home:
        return {k: _code_of(v) for k, v in vars(value).items()
                if isinstance(v, (types.FunctionType, staticmethod, classmethod, property))}
    if type(value) in (dict, list, tuple):
        items = value.items() if type(value) is dict else enumerate(value)
        return {k: _code_of(v) for k, v in list(items)[:512] if isinstance(v, _FUNCTIONS)}
    if isinstance(value, types.ModuleType):
        return id(value)
    return None


def grader_state(modules: list[types.ModuleType]) -> dict[str, Any]:
    """A picture of the check's and the reference's ``modules`` (:func:`grader_modules`; module docstring, third
    look), by qualified name."""
    out: dict[str, Any] = {}
    for m in modules:
        for k, v in list(vars(m).items()):
            if k.startswith("__"):
                continue
            pic = _picture(v, m.__name__)
            if pic is not None and pic != {}:
                out[f"{m.__name__}.{k}"] = pic
    return out


def grader_state_changed(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """The first name whose picture changed (replaced or deleted; a method of its class, an entry of its table
    rewritten or deleted: entries a check adds to its own tables later are not a change), or None."""
    for k, v in before.items():
        now = after.get(k)
        if isinstance(v, dict) and isinstance(now, dict):
            entry = next((e for e, c in v.items() if now.get(e) != c), None)
            if entry is not None:
                return f"{k} (its {entry!r})"
        elif now != v:
            return k
    return None
