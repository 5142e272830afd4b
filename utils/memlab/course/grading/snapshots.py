"""Pictures of state for the grading harness (:mod:`.harness`): :func:`snapshot` of an argument, a global or a
class attribute, and :func:`difference` of two pictures in words.

A tensor is pictured by its dtype, shape, strides, storage offset, ``requires_grad``, the bytes of its whole
storage (read with ``ctypes.string_at``: no torch op, so a check's dispatch modes, trackers and allocator profiles
see nothing) and its ``.grad``; a list, tuple or dict by its contents; a module by its parameters, buffers,
gradients, training flag, hooks and the callables set on its instances (a ``forward``); a function by its code
and defaults; an optimizer by its groups, parameters and state; a dataclass by its fields;
an instance of a class the learner wrote by its attributes; anything else by its identity.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import sys
import types
from typing import Any

from memlab.course.grading.registry import is_learner_file

__all__ = ["snapshot", "difference", "learner_classes"]


def learner_classes(cls: type) -> list[type]:
    """The classes in ``cls``'s MRO whose methods the learner wrote (a notebook cell, a script)."""
    out = []
    for klass in cls.__mro__:
        fns = [getattr(v, "__func__", v) for v in vars(klass).values()]
        if any(isinstance(f, types.FunctionType) and is_learner_file(f.__code__.co_filename) for f in fns):
            out.append(klass)
    return out


_BYTES_KEPT = 1 << 20  # storages up to 1 MiB are kept as bytes (to say which element changed), larger hashed


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _storage_bytes(t: Any) -> tuple[int, bytes | str | None]:
    """(nbytes, the storage's bytes or their hash) without a torch op or allocation: a check's dispatch
    modes, trackers and allocator profiles see nothing of the probe."""
    try:
        st = t.untyped_storage()
        n, ptr = st.nbytes(), st.data_ptr()
    except Exception:  # noqa: BLE001 - a tensor subclass without a storage
        return -1, None
    if t.device.type == "meta" or n == 0 or ptr == 0 or type(t).__name__ == "FakeTensor":
        return n, None
    if t.device.type != "cpu":
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            import torch

            data = bytes(torch.empty(0, dtype=torch.uint8, device=t.device).set_(st).cpu().numpy().tobytes())
    else:
        data = ctypes.string_at(ptr, n)
    return n, data if n <= _BYTES_KEPT else hashlib.blake2b(data, digest_size=16).hexdigest()


def _tensor_snap(t: Any, depth: int) -> tuple:
    n, data = _storage_bytes(t)
    grad = t.grad if (t.is_leaf and t.requires_grad) else None
    return ("tensor", t.dtype, tuple(t.shape), tuple(t.stride()) if t.layout == _strided() else None,
            t.storage_offset() if t.layout == _strided() else None, t.requires_grad, n, data,
            None if grad is None else _tensor_snap(grad, depth + 1))


def _strided() -> Any:
    import torch

    return torch.strided


def _hooks(module: Any) -> int:
    return sum(len(getattr(m, name, {}) or {}) for m in module.modules()
               for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def snapshot(x: Any, depth: int = 0) -> Any:
    """A comparable picture of ``x``'s state (see the module docstring); objects the harness does not
    look into are pictured by identity."""
    if depth > 6:
        return ("deep", id(x))
    if x is None or type(x) in (bool, int, float, complex, str, bytes):
        return ("value", type(x), x if x == x else "nan")
    if _is_tensor(x):
        return _tensor_snap(x, depth)
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(x, (torch.dtype, torch.device, torch.Size)):
            return ("value", type(x), x)
        if isinstance(x, torch.nn.Module):
            return ("module", type(x), x.training, _hooks(x),
                    tuple((n, snapshot(p, depth + 1)) for n, p in x.named_parameters(remove_duplicate=False)),
                    tuple((n, snapshot(b, depth + 1)) for n, b in x.named_buffers(remove_duplicate=False)),
                    _module_methods(x))
        if isinstance(x, torch.optim.Optimizer):
            groups = tuple(tuple(sorted((k, snapshot(v, depth + 1) if k != "params" else tuple(map(id, v)))
                                        for k, v in g.items())) for g in x.param_groups)
            params = tuple(snapshot(p, depth + 1) for g in x.param_groups for p in g["params"])
            state = tuple((id(p), snapshot(dict(s), depth + 1)) for p, s in x.state.items())
            return ("optimizer", type(x), groups, params, state)
    if isinstance(x, types.FunctionType):  # what it runs: its code and defaults (a rewritten __code__ shows)
        return ("function", id(x), id(x.__code__), x.__defaults__ is None or tuple(map(id, x.__defaults__)))
    if type(x) in (list, tuple) or (isinstance(x, tuple) and hasattr(x, "_fields")):
        if len(x) > 4096:
            return ("seq", type(x), len(x), tuple(map(id, x)))
        return ("seq", type(x), tuple(snapshot(v, depth + 1) for v in x))
    if isinstance(x, dict) and type(x).__module__ in ("builtins", "collections"):
        if len(x) > 4096:
            return ("dict", type(x), len(x), tuple(map(id, x.values())))
        return ("dict", type(x), tuple((k if isinstance(k, (str, int, float, bool, tuple)) else ("id", id(k)),
                                         snapshot(v, depth + 1)) for k, v in x.items()))
    if isinstance(x, (set, frozenset)):
        return ("set", type(x), len(x), frozenset(id(v) for v in x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return ("dataclass", type(x), tuple((f.name, snapshot(getattr(x, f.name, None), depth + 1))
                                            for f in dataclasses.fields(x)))
    if learner_classes(type(x)) and isinstance(getattr(x, "__dict__", None), dict):
        # an instance of a class the learner wrote (a cache object, a counter): its attributes
        return ("instance", type(x), id(x), tuple((k, snapshot(v, depth + 1)) for k, v in vars(x).items()))
    return ("object", type(x), id(x))


def _module_methods(module: Any) -> tuple:
    """(submodule path, attribute, identity) of every callable set on a module's (or a submodule's) instance: a
    ``forward`` put on the instance replaces what the module computes."""
    return tuple((name, k, id(v)) for name, m in module.named_modules() for k, v in vars(m).items()
                 if not k.startswith("_") and callable(v))


def _tensor_change(before: tuple, after: tuple) -> str:
    names = ("", "dtype", "shape", "stride", "storage offset", "requires_grad", "storage size (bytes)")
    for i in range(1, 7):
        if before[i] != after[i]:
            return f"its {names[i]} changed from {before[i]} to {after[i]}"
    if before[7] != after[7]:
        if isinstance(before[7], bytes) and isinstance(after[7], bytes) and len(before[7]) == len(after[7]):
            diff = sum(a != b for a, b in zip(before[7], after[7]))
            return f"its values changed ({diff} of {len(before[7])} bytes of its storage differ)"
        return "its values changed"
    if before[8] != after[8]:
        return "its .grad changed" if before[8] is not None and after[8] is not None else (
            "it gained a .grad" if before[8] is None else "its .grad was removed")
    return "it changed"


def difference(before: Any, after: Any, path: str = "") -> str | None:
    """Where two :func:`snapshot` pictures differ, in words (``"[1]: its values changed"``), or None."""
    if _same(before, after):
        return None
    kind = before[0] if isinstance(before, tuple) and before else None
    if not (isinstance(after, tuple) and after and after[0] == kind):
        return f"{path}: it was replaced"
    if kind == "tensor":
        return f"{path}: {_tensor_change(before, after)}"
    if kind == "seq":
        if len(before) != 3 or len(after) != 3:
            return f"{path}: its contents changed"
        if len(before[2]) != len(after[2]):
            return f"{path}: its length changed from {len(before[2])} to {len(after[2])}"
        for i, (b, a) in enumerate(zip(before[2], after[2])):
            d = difference(b, a, f"{path}[{i}]")
            if d:
                return d
    if kind == "dict":
        if len(before) == 3 and len(after) == 3:
            bk, ak = [k for k, _ in before[2]], [k for k, _ in after[2]]
            if bk != ak:
                return f"{path}: its keys changed from {_short(bk)} to {_short(ak)}"
            for (k, b), (_, a) in zip(before[2], after[2]):
                d = difference(b, a, f"{path}[{k!r}]")
                if d:
                    return d
        return f"{path}: its contents changed"
    if kind == "module":
        if before[2] != after[2]:
            return f"{path}: its training flag changed"
        if before[3] != after[3]:
            return f"{path}: {after[3] - before[3]:+d} hook(s) left installed on it"
        for (n, b), (_, a) in zip(before[4] + before[5], after[4] + after[5]):
            d = difference(b, a, f"{path}.{n}")
            if d:
                return d
        if len(before) > 6 and before[6] != after[6]:
            changed = sorted({f"{m + '.' if m else ''}{k}" for m, k, _ in set(before[6]) ^ set(after[6])})
            return f"{path}: {', '.join(changed)} was set, replaced or removed on it (what the module computes)"
        return f"{path}: its parameters or buffers changed"
    if kind == "optimizer":
        if before[2] != after[2]:
            return f"{path}: its param_groups changed"
        for i, (b, a) in enumerate(zip(before[3], after[3])):
            d = difference(b, a, f"{path} parameter {i}")
            if d:
                return d
        return f"{path}: its state changed"
    if kind == "instance":
        if [k for k, _ in before[3]] != [k for k, _ in after[3]]:
            return f"{path}: its attributes changed"
        for (n, b), (_, a) in zip(before[3], after[3]):
            d = difference(b, a, f"{path}.{n}")
            if d:
                return d
    if kind == "function":
        return f"{path}: its code or defaults were replaced (what the function computes)"
    if kind == "dataclass":
        for (n, b), (_, a) in zip(before[2], after[2]):
            d = difference(b, a, f"{path}.{n}")
            if d:
                return d
    return f"{path}: it changed"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == is odd (a learner's type): compare identities
        return a is b


def _short(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."
