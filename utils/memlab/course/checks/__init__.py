"""The graded checks, one module per chapter (``ch00.py``, ``ch01.py`` ...).

Each check is plain code a learner can read: it calls your function or class on a few inputs
and compares the answer with memlab's own implementation, raising AssertionError with a
message that says what was expected. ``memlab.course.grading.check`` runs them.

Every ``check_*`` function registered with ``@register("NN.name", reference=...)`` has one contract,
stated here once rather than in each docstring: its argument is the learner's answer (a function or
a class) for that exercise, held against the reference; it returns None when every case agrees and
raises AssertionError naming the first case where the answer is wrong, the answer and the expected
one (a lab's untouched stub raises NotImplementedError, graded as todo).

Helpers below keep the messages uniform: "name: got X, expected Y". They compare exact types
and compare values through the *reference's* type: an ``int`` subclass whose ``==`` always
says yes is not an int, and a dict's values are compared one by one, never with the learner's
own ``==``. (The standard library's dict subclasses, ``defaultdict``, ``OrderedDict`` and
``Counter``, count as dicts; ``nn.Parameter`` counts as a tensor.)
"""
from __future__ import annotations

import collections
import math
import sys
import weakref
from typing import Any

from memlab.course.grading import register
from memlab.course.grading.cases import (
    LAYOUTS, Case, Space, current_pass, differential, flags, floats, ints, layouts, lists_of, make_tensor, one_of,
)

__all__ = ["register", "expect", "expect_equal", "expect_close", "expect_tensor_close", "expect_type",
           "exact_type", "same_value", "Space", "Case", "differential", "ints", "floats", "one_of", "flags",
           "lists_of", "layouts", "LAYOUTS", "make_tensor", "current_pass", "BlockReuse", "wrapped_as_drawn", "own_copies"]

_DICTS = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter)


def expect(condition: bool, message: str) -> None:
    """AssertionError(``message``: what was expected, what came back) unless ``condition`` holds."""
    if not condition:
        raise AssertionError(message)


def _type_name(t: type) -> str:
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _repr(x: Any, limit: int = 120) -> str:
    """``repr(x)``, cut to ``limit`` characters, and never raising (a learner's ``__repr__`` may)."""
    try:
        text = repr(x)
    except BaseException:  # noqa: BLE001
        text = f"<{_type_name(type(x))} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_tensor_type(t: type) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and t in (torch.Tensor, torch.nn.Parameter)


def exact_type(got: Any, kind: type | tuple[type, ...]) -> bool:
    """Whether ``type(got)`` is exactly ``kind`` (or one of them): subclasses do not count, except
    the standard library's dict subclasses for ``dict`` and ``nn.Parameter`` for ``torch.Tensor``;
    an int also passes as a float.
    """
    kinds = kind if isinstance(kind, tuple) else (kind,)
    t = type(got)
    for k in kinds:
        if t is k or (k is dict and t in _DICTS) or (_is_tensor_type(k) and _is_tensor_type(t)):
            return True
        if k is float and t is int:  # an int is an acceptable float (0 for 0.0), never the other way round
            return True
    return False


def raise_if_triton_stub(kernel: Any) -> None:
    """A lab's Triton stub holds a ``raise NotImplementedError(...)`` line, which is not Triton (compiled, it
    would be a compile error): raise it here so that the grader says "todo"."""
    import inspect
    import re

    try:
        src = inspect.getsource(kernel.fn)
    except (AttributeError, OSError, TypeError):
        src = ""
    stub = re.search(r"""raise NotImplementedError\((["'])(.*?)\1\)""", src)
    if stub:
        raise NotImplementedError(stub.group(2))


def expect_type(name: str, got: Any, kind: type | tuple[type, ...]) -> None:
    """Fail unless ``got``'s type is exactly ``kind`` (see :func:`exact_type`); the message names
    ``name`` (an expression such as ``fn(3)``), the expected type and the type and value that came back."""
    names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    expect(exact_type(got, kind), f"{name}: expected a {names}, got {_type_name(type(got))} ({_repr(got, 80)})")


class _TypeMismatch(Exception):
    def __init__(self, path: str, expected: str, got: Any) -> None:
        super().__init__(path)
        self.path, self.expected, self.got = path, expected, got


class _ValueMismatch(Exception):
    pass


def _compare(got: Any, want: Any, path: str) -> None:
    """Raise _TypeMismatch or _ValueMismatch unless ``got`` equals ``want`` through ``want``'s type."""
    wt = type(want)
    if want is None:
        if got is not None:
            raise _TypeMismatch(path, "None", got)
        return
    if wt is bool:
        if type(got) is not bool:
            raise _TypeMismatch(path, "bool", got)
        if got is not want:
            raise _ValueMismatch(path)
    elif wt is int:
        if type(got) is not int:
            raise _TypeMismatch(path, "int", got)
        if not int.__eq__(want, got):
            raise _ValueMismatch(path)
    elif wt is float:
        if type(got) not in (float, int):
            raise _TypeMismatch(path, "float", got)
        g = float(got)
        if not (g == want or (math.isnan(g) and math.isnan(want))):
            raise _ValueMismatch(path)
    elif wt in (str, bytes):
        if type(got) is not wt:
            raise _TypeMismatch(path, wt.__name__, got)
        if not wt.__eq__(want, got):
            raise _ValueMismatch(path)
    elif wt in (list, tuple):
        if type(got) is not wt:
            raise _TypeMismatch(path, wt.__name__, got)
        if wt.__len__(got) != len(want):
            raise _ValueMismatch(path)
        for i, w in enumerate(want):
            _compare(wt.__getitem__(got, i), w, f"{path}[{i}]")
    elif isinstance(want, dict) and wt in _DICTS:
        if type(got) not in _DICTS:
            raise _TypeMismatch(path, "dict", got)
        keys = list(dict.keys(got))
        key_types = {type(k) for k in want}
        for k in keys:
            if key_types and type(k) not in key_types:
                raise _TypeMismatch(f"{path} key {_repr(k, 40)}", " or ".join(sorted(t.__name__ for t in key_types)), k)
        if set(keys) != set(want):
            raise _ValueMismatch(path)
        for k, w in want.items():
            _compare(dict.__getitem__(got, k), w, f"{path}[{k!r}]")
    elif _is_tensor_type(wt):
        import torch

        if not _is_tensor_type(type(got)):
            raise _TypeMismatch(path, "torch.Tensor", got)
        same = (got.shape == want.shape and got.dtype == want.dtype
                and torch.equal(torch.Tensor.cpu(got.detach()), want.detach().cpu()))
        if not same:
            raise _ValueMismatch(path)
    else:
        if type(got) is not wt:
            raise _TypeMismatch(path, _type_name(wt), got)
        verdict = wt.__eq__(want, got)
        if verdict is NotImplemented or not (verdict is True or (type(verdict) is bool and verdict)):
            raise _ValueMismatch(path)


def same_value(got: Any, want: Any) -> bool:
    """Whether ``got`` equals the reference answer ``want`` with exact types, compared through
    ``want``'s type (see :func:`expect_equal`)."""
    try:
        _compare(got, want, "")
    except (_TypeMismatch, _ValueMismatch):
        return False
    return True


def expect_equal(name: str, got: Any, want: Any) -> None:
    """Fail unless ``got`` equals ``want`` with exact types, compared through ``want``'s type.

    Containers are compared element by element (dicts key by key), so the learner's own ``==``
    is never the judge: an ``int`` subclass that says yes to everything fails here. The message
    names the first element with the wrong type, or the value and the expected one.
    """
    try:
        _compare(got, want, "")
    except _TypeMismatch as m:
        raise AssertionError(f"{name}{m.path}: expected {'an' if m.expected[0] in 'aeiou' else 'a'} {m.expected}, "
                             f"got {_type_name(type(m.got))} ({_repr(m.got, 80)})") from None
    except _ValueMismatch:
        raise AssertionError(f"{name}: got {_repr(got, 200)}, expected {want!r}") from None


def expect_close(name: str, got: Any, want: float, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """Fail unless ``got`` is a Python number (exactly float or int), finite and within
    ``atol + rtol * abs(want)`` of ``want``; the message gives both values and the tolerance (a
    tensor gets a hint to call ``.item()``)."""
    if type(got) not in (float, int):
        raise AssertionError(f"{name}: expected a number (a Python float), got {_type_name(type(got))} ({_repr(got, 80)})"
                             + ("; return .item() of the tensor" if _is_tensor_type(type(got)) else ""))
    g = float(got)
    ok = math.isfinite(g) and abs(g - want) <= atol + rtol * abs(want)
    expect(ok, f"{name}: got {g:.6g}, expected {want:.6g} (tolerance {atol + rtol * abs(want):.3g})")


def expect_tensor_close(name: str, got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Fail unless ``got`` is a tensor of ``want``'s shape and dtype with values within ``rtol``/``atol``
    (as in :func:`torch.allclose`); the message names a wrong type, shape or dtype, or the largest
    absolute difference."""
    import torch

    expect_type(name, got, torch.Tensor)
    expect(tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    expect(got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}")
    g, w = got.detach().float().cpu(), want.detach().float().cpu()
    if torch.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True):
        return
    diff = (g - w).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    raise AssertionError(f"{name}: values differ, max abs diff {diff.max().item():.3g} (rtol={rtol}, atol={atol})")


class BlockReuse:
    """New CPU tensors the way an allocator hands out memory: the next one reuses the last one's bytes (the
    same address) once that tensor's storage has died, and gets fresh memory while it is still alive.

    A count keyed by storage identity sees each tensor once; one keyed by address sees one block, unless
    it holds what it counts (then no block is reused). Checks use it for "storages made in turn at one
    address", so that both right answers pass and only an address-keyed count that lets go fails."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._mem = bytearray(nbytes)
        self._last: Any = None

    def tensor(self, *shape: int, dtype: Any = None) -> Any:
        """A float32 (or ``dtype``) tensor of ``shape`` on the pool's block, or on a new one if the last is held."""
        import torch

        if self._last is not None and self._last() is not None:
            self._mem = bytearray(self.nbytes)  # the block is still in use: the allocator gives another
        t = torch.frombuffer(self._mem, dtype=dtype or torch.float32).view(*shape)
        self._last = weakref.ref(t.untyped_storage())
        return t


def own_copies(*objs: Any) -> tuple[Any, ...]:
    """Deep copies of ``objs`` for the reference (tensors keep their storage, offset, strides and
    ``requires_grad``; modules their parameters; a function is itself): a check runs the reference FIRST, on
    its own copies, then the answer on the originals, so that an answer that changes what it was given (a
    module's ``forward``, a function's code) cannot change what the reference measures."""
    import copy

    return copy.deepcopy(objs)


def wrapped_as_drawn(f: Any, case: Any) -> Any:
    """``f`` as a drawn case of 00.saved_bytes or 02.count_saved hands it over (``case.wrap``, ``rows``,
    ``cols``, ``dtype``, ``seed``): a plain function; a module that first multiplies by its own weight (a
    parameter saved for backward is not an activation); or a function that first saves three storages made
    in turn, each freed before the next (an allocator reuses the block: one address, three storages)."""
    import torch
    from torch import nn
    if case.wrap == "a module with a weight":
        class Weighted(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = nn.Parameter(make_tensor((case.cols, case.cols), case.dtype, "contiguous", case.seed + 1))

            def forward(self, t):
                return f(t @ self.weight)

        return Weighted()
    if case.wrap == "storages made in turn at one address":
        pool = BlockReuse(case.rows * case.cols * torch.empty(0, dtype=case.dtype).element_size())

        def reused(t):
            for _ in range(3):
                (t * pool.tensor(case.rows, case.cols, dtype=case.dtype)).float().sum()
            return f(t)

        return reused
    return f
