"""Training state on disk that loses nothing: one file, written atomically, verified before it is loaded.

A training checkpoint is a tree of plain values (dicts, lists, ints, floats, strings, None) with
tensors as leaves: the model's ``state_dict``, the optimizer's, the RNG states, the data position,
the stack in use. :func:`save` writes the whole tree as **one safetensors file** (Hugging Face's
format, https://github.com/huggingface/safetensors, README "Format": an 8-byte little-endian
header length, a JSON header naming each tensor's dtype, shape and byte range, then the raw
bytes). Everything that is not a tensor is JSON in the header's ``__metadata__`` (key
``memlab.state``), each tensor leaf replaced by ``{"__tensor__": name}``. Reader and writer are
written here (no dependency; the files load with the ``safetensors`` package too), and reading
never unpickles anything.

* **atomic**: :func:`atomic_write` writes a temporary file in the same directory, ``fsync``s it,
  ``os.replace``s it onto the name (POSIX ``rename(2)``: no reader finds the name missing or
  half-written) and ``fsync``s the directory. A process killed at any instant leaves the previous
  or the new complete file, at worst a stray ``.<name>.tmp-*`` that :func:`remove_stale_temps`
  clears and loaders ignore.
* **verified**: the metadata holds ``memlab.sha256`` over the canonical header and the tensor
  bytes; :func:`load` checks lengths, header, tensor table and checksum before it builds anything,
  and a truncated or corrupted file raises :class:`CheckpointError` naming the file and the fault.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import secrets
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from memlab.core.units import MiB

__all__ = ["CheckpointError", "save", "load", "atomic_write", "serialize", "deserialize", "read_state_json",
           "remove_stale_temps", "temp_files", "iter_checkpoints", "step_of", "rng_state", "set_rng_state", "DTYPES"]

FORMAT = "memlab.train.state/1"  # written into every file: the name stays
_STATE_KEY = "memlab.state"
_SHA_KEY = "memlab.sha256"
_FORMAT_KEY = "memlab.format"
# safetensors' dtype names
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * MiB  # safetensors' own limit on the header's size
_MAX_DIMS = 64  # more dimensions than torch.Tensor takes
_INT64_MAX = 2**63 - 1
_TEMP_RE = re.compile(r"^\..+\.tmp-[0-9]+-[0-9a-f]+$")


class CheckpointError(ValueError):
    """A checkpoint file that must not be loaded (truncated, corrupted, not a memlab checkpoint)."""


# ----------------------------------------------------------------------------- the tree
def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor], ids: dict[int, str]) -> Any:
    # The JSON-able skeleton of ``obj``; its tensors go into ``tensors`` under dotted paths.
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in DTYPES:
            raise TypeError(f"save: tensor at {path or '<root>'} has dtype {obj.dtype}; allowed: "
                            f"{', '.join(str(d) for d in DTYPES)}")
        name = path or "<root>"
        tensors[name] = obj
        return {"__tensor__": name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{path}.{i}" if path else str(i), tensors, ids) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _flatten(v, f"{path}.{k}" if path else k, tensors, ids) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"save: dict key {k!r} at {path or '<root>'} is a {type(k).__name__}; allowed: "
                                "str, int, float, bool, None")
            items.append([k, _flatten(v, f"{path}.{k}" if path else str(k), tensors, ids)])
        return {"__items__": items}
    raise TypeError(f"save: value at {path or '<root>'} is a {type(obj).__name__}; allowed: tensors, dict, list, "
                    "tuple, str, int, float, bool, None (convert NumPy arrays with .tolist())")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__items__"}:
            return {k: _unflatten(v, tensors) for k, v in obj["__items__"]}
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    return obj


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()  # native order: little-endian on x86 and ARM


# ----------------------------------------------------------------------------- bytes
def serialize(state: Any) -> list[bytes]:
    """The checkpoint file's bytes for ``state`` (a tree of dicts, lists, tuples and plain values with
    tensors as leaves), as chunks: the header first, then each tensor's bytes."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "", tensors, {})
    table: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        b = _tensor_bytes(tensors[name])
        t = tensors[name]
        table[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    meta = {_FORMAT_KEY: FORMAT, _STATE_KEY: json.dumps(skeleton, allow_nan=True)}
    digest = hashlib.sha256(_canonical({**table, "__metadata__": meta}))
    for b in blobs:
        digest.update(b)
    header = {"__metadata__": {**meta, _SHA_KEY: digest.hexdigest()}, **table}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    return [struct.pack("<Q", len(raw)) + raw, *blobs]


def _parse(data: bytes, where: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    # Check the layout and the checksum of a file's bytes; (metadata, tensor table, data start).
    n = len(data)
    if n < 8:
        raise CheckpointError(f"{where}: truncated: {n} bytes, shorter than the 8-byte header length; refusing to load")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > _MAX_HEADER or 8 + hlen > n:
        raise CheckpointError(f"{where}: truncated or corrupted: the header claims {hlen} bytes but the file has "
                              f"{n - 8} after the length field; refusing to load")
    try:
        header = json.loads(data[8:8 + hlen].decode("utf-8"))
    except ValueError as exc:  # not UTF-8, not JSON, or an int of more digits than Python converts
        raise CheckpointError(f"{where}: corrupted header (not JSON: {str(exc)[:200]}); refusing to load") from None
    except RecursionError:
        raise CheckpointError(f"{where}: malformed header (JSON nested too deeply to read); refusing to load") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CheckpointError(f"{where}: not a memlab checkpoint (no __metadata__ in the header); refusing to load")
    meta = dict(header.pop("__metadata__"))
    if meta.get(_FORMAT_KEY) != FORMAT or not isinstance(meta.get(_STATE_KEY), str):
        raise CheckpointError(f"{where}: not a memlab checkpoint (metadata {sorted(meta)[:5]}); expected "
                              f"{_FORMAT_KEY}={FORMAT!r}; refusing to load")
    sha = meta.pop(_SHA_KEY, None)
    start = 8 + hlen
    end = 0
    try:
        ranges = sorted(_check_entry(name, info, where, n - start) for name, info in header.items())
    except RecursionError:  # an entry nested too deeply to describe
        raise CheckpointError(f"{where}: malformed tensor table (nested too deeply); refusing to load") from None
    for lo, hi in ranges:
        if lo != end:  # safetensors' layout: the byte ranges tile the data, in order, with no gap or overlap
            raise CheckpointError(f"{where}: corrupted tensor table (a byte range starts at {lo}, expected {end}: "
                                  "ranges overlap or leave a gap); refusing to load")
        end = hi
    if start + end != n:
        what = "truncated" if start + end > n else "has trailing bytes"
        raise CheckpointError(f"{where}: {what}: {n} bytes, the header describes {start + end}; refusing to load")
    digest = hashlib.sha256(_canonical({**header, "__metadata__": meta}))
    digest.update(memoryview(data)[start:])
    if sha != digest.hexdigest():
        raise CheckpointError(f"{where}: checksum mismatch (stored sha256 {str(sha)[:16]}..., computed "
                              f"{digest.hexdigest()[:16]}...): the file is corrupted; refusing to load")
    return meta, header, start


def _check_entry(name: str, info: Any, where: str, size: int) -> tuple[int, int]:
    # One tensor's entry of the table, checked field by field (a crafted file may hold any JSON there):
    # its byte range (lo, hi) within the ``size`` data bytes, or a CheckpointError naming the entry.
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: corrupted tensor entry {name[:80]!r}: {why}; refusing to load")

    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        keys = sorted(map(str, info))[:5] if isinstance(info, dict) else type(info).__name__
        raise bad(f"expected the keys dtype, shape, data_offsets, got {keys}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _FROM_NAME:
        raise bad(f"dtype={str(dtype)[:40]!r}; allowed: {', '.join(_FROM_NAME)}")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(_is_count(s) for s in shape):
        raise bad(f"shape={str(shape)[:60]}; allowed: a list of at most {_MAX_DIMS} ints from 0 to 2**63 - 1")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad(f"data_offsets={str(offsets)[:60]}; allowed: [begin, end], two ints from 0 to 2**63 - 1")
    lo, hi = offsets
    numel, extent = 1, 1  # extent: the product of the non-zero dimensions (what a stride must hold)
    for s in shape:
        numel, extent = numel * s, extent * max(s, 1)
        if extent > _INT64_MAX:
            raise bad(f"shape={shape} has more than 2**63 - 1 elements")
    if not lo <= hi <= size or hi - lo != numel * _FROM_NAME[dtype].itemsize:
        raise bad(f"data_offsets {lo}..{hi} do not hold {shape} x {dtype} within the file's {size} data bytes")
    return lo, hi


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _INT64_MAX


def deserialize(data: bytes, where: str = "<bytes>", *, device: str | torch.device = "cpu") -> Any:
    """The state that :func:`serialize` turned into ``data``, after every check of :func:`load`;
    ``where`` names the data (a path) in error messages.

    Raises:
        CheckpointError: the data is truncated, malformed or fails its checksum.
    """
    meta, table, start = _parse(data, where)
    tensors: dict[str, torch.Tensor] = {}
    for name, info in table.items():
        dtype = _FROM_NAME[info["dtype"]]
        lo, hi = info["data_offsets"]
        if hi == lo:
            t = torch.empty(info["shape"], dtype=dtype)
        else:
            t = torch.frombuffer(bytearray(data[start + lo:start + hi]), dtype=dtype).reshape(info["shape"])
        tensors[name] = t.to(device)
    try:
        skeleton = json.loads(meta[_STATE_KEY])
        return _unflatten(skeleton, tensors)
    except RecursionError:
        raise CheckpointError(f"{where}: malformed state (JSON nested too deeply to read); refusing to load") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:  # checksum passed: a writer bug
        raise CheckpointError(f"{where}: the state JSON does not match the tensors ({exc!r}); refusing to load") from None


# ----------------------------------------------------------------------------- files
def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory: the rename is durable there on its own
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, chunks: Iterable[bytes]) -> Path:
    """Write ``chunks`` to ``path`` so that ``path`` is always either the old file or the new one.

    Temp file in the same directory (``.<name>.tmp-<pid>-<random>``), write, flush, ``fsync``,
    ``os.replace`` onto ``path``, ``fsync`` the directory. If anything fails before the rename the
    temp file is removed and ``path`` is untouched. Returns ``path`` as a Path.
    """
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise ValueError(f"path={str(path)!r} is not a file name; allowed: a path to a file")
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"path={str(path)!r}: the directory {str(directory)!r} does not exist")
    tmp = directory / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
    return path


def save(state: Any, path: str | os.PathLike) -> Path:
    """Write ``state`` (a tree of tensors and plain values) to ``path`` atomically; returns the path.

    Tuples come back as tuples, dicts with non-string keys (an optimizer's ``state``) with their
    keys; tensors come back on the CPU, contiguous, with their dtype and shape.
    """
    return atomic_write(path, serialize(state))


def _read(path: str | os.PathLike) -> tuple[bytes, str]:
    p = Path(path)
    try:
        return p.read_bytes(), str(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"path={str(p)!r}: no such checkpoint file") from None
    except OSError as exc:  # a directory, no permission, an I/O error
        raise CheckpointError(f"{p}: unreadable ({exc.strerror or exc}); refusing to load") from None


def load(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> Any:
    """Read a checkpoint written by :func:`save`, verified before anything is built (tensors on ``device``).

    Raises:
        CheckpointError: the file is truncated, malformed or fails its checksum.
        FileNotFoundError: no such file.
    """
    data, where = _read(path)
    return deserialize(data, where, device=device)


def read_state_json(path: str | os.PathLike) -> dict[str, Any]:
    """The verified non-tensor part of a checkpoint: the state tree, each tensor shown as ``{"__tensor__": name}``.

    Raises:
        CheckpointError: the file is truncated, malformed or fails its checksum.
    """
    data, where = _read(path)
    meta, _, _ = _parse(data, where)
    try:
        return json.loads(meta[_STATE_KEY])
    except RecursionError:
        raise CheckpointError(f"{where}: malformed state (JSON nested too deeply to read); refusing to load") from None
    except ValueError as exc:
        raise CheckpointError(f"{where}: malformed state JSON ({exc}); refusing to load") from None


def temp_files(directory: str | os.PathLike) -> list[Path]:
    """Leftover temp files of :func:`atomic_write` (from a writer that was killed)."""
    return sorted(p for p in Path(directory).iterdir() if _TEMP_RE.match(p.name))


def remove_stale_temps(directory: str | os.PathLike) -> int:
    """Delete leftover temp files of killed writers in ``directory``; returns how many.

    Only call it when no other process is writing checkpoints into ``directory``.
    """
    n = 0
    for p in temp_files(directory):
        try:
            p.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n


_STEP_RE = re.compile(r"(\d+)")


def step_of(path: str | os.PathLike) -> int | None:
    """The step number in a checkpoint's file name: its last run of digits, or ``None`` if it has none."""
    found = _STEP_RE.findall(Path(path).name)
    return int(found[-1]) if found else None


def iter_checkpoints(directory: str | os.PathLike, pattern: str = "step-*.safetensors") -> Iterator[Path]:
    """Checkpoint files in ``directory`` matching ``pattern``, highest step number first.

    Ordered by the step number in the name, not by the name (``step-100000000`` is newer than
    ``step-99999999``); names without a number come last. Only regular files count.
    """
    files = [p for p in Path(directory).glob(pattern) if p.is_file()]
    return iter(sorted(files, key=lambda p: (step_of(p) is not None, step_of(p) or 0, p.name), reverse=True))


# ----------------------------------------------------------------------------- the RNG states
def rng_state() -> dict[str, Any]:
    """The RNG states a resume restores (torch, Python, NumPy, and CUDA once initialised), as plain values."""
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


def set_rng_state(state: dict[str, Any]) -> None:
    """Set the RNG states :func:`rng_state` captured (those of a loaded checkpoint)."""
    torch.set_rng_state(state["torch"])
    v = state["python"]
    random.setstate((v[0], tuple(v[1]), v[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4]))
