"""The fake-tensor mode the estimator traces under: PyTorch's ``FakeTensorMode`` with a cheaper key for its
dispatch cache; and a fake build without weight initialisation (:func:`no_weight_init`).

A fake-tensor op that PyTorch has seen before with inputs of the same metadata is answered from a cache
(``FakeTensorMode.cache``) instead of running its meta kernel. The key of each fake tensor input is built
field by field (``torch._subclasses.fake_tensor.extract_tensor_metadata``: 17 fields, among them the memory
format that ``suggest_memory_format`` derives from the strides, and ``is_contiguous``), in Python, and on a
traced training step that costs more than the cache saves: a third of a suggestion row's time
(``memlab estimate llama-2-7b --gpu rtx4090``, sampled with py-spy on the 2-core CPU).

:class:`QuickKeyFakeTensorMode` keys a strided fake tensor of its own with sizes and strides that are plain
integers by one tuple of what can differ between two such tensors: dtype, sizes, strides, device, storage
offset, storage bytes, ``requires_grad``, quantized, conjugate and negative bits, inference. The fields of
PyTorch's key left out are functions of those (the memory format and contiguity follow from sizes and
strides) or fixed for a strided tensor (layout, the sparse fields), so two inputs share a quick key exactly
when they share PyTorch's: the cache answers the same ops with the same entries, and a trace is the same to
the byte (``tests/ch01/test_fake_mode.py``). Every other input (a constant, a symbolic size, a tensor of
another mode, a sparse one, a callable) goes through PyTorch's own code, which raises its bypasses as before.
A marker object goes with every tensor and sequence keyed here, so no key with one equals a key PyTorch made (the
cache is shared by all modes); a key without one (an op of plain values only) is PyTorch's own.

Its ``__torch_dispatch__`` is also leaner than PyTorch's, with the same answers: PyTorch wraps the mode's hook in two
decorators (one switches Dynamo's frame evaluation off and on around every op, the other counts calls for PyTorch's
own debugging) and its ``dispatch`` enters a no-dispatch guard for a debug log line on every op. Here the hook goes to
the same steps (the meta handlers, the ops answered directly, the cache) without them, and to PyTorch's ``dispatch``
itself whenever its logger is at debug level. Nothing is compiled inside the hook; the saving is about 5% of a traced
step (:func:`_lean_dispatch_supported`; timed on the 2-core CPU, Llama-2-7B shapes at 5 layers: 197 -> 188 ms).
One op is answered before those steps: ``.item()`` (``aten._local_scalar_dense``) of a fake tensor of this mode that
carries a constant (the step count an optimizer keeps on the host, read twice per parameter per step for the bias
corrections) is the constant's own ``.item()``, as PyTorch's constant propagation answers it after failing to key it for
the cache (an op with a data-dependent output is never cached); a few percent more (188 -> 180 ms). And
``aten._unsafe_view`` (every linear layer's 3-D output reshaped after its matmul), which PyTorch's cache refuses to
hold, is answered by the cache entry of ``view``: ATen computes both the same way, the autograd view link aside,
which the layers above the mode make by the op's name (another 5%, 154 -> 146 ms). ``torch.tensor(0.0)`` (each
parameter's step count, made by the optimizer's first step) lifts a real 0-dim CPU tensor into the mode: PyTorch clones
it and runs its general converter from real tensors (a description of some forty fields, then the meta tensor), which
for such a scalar comes to a fake 0-dim tensor on the CPU holding the clone as its constant, with the converter's
memos (the clone's tensor and storage, the constant's aliases) filled; the mode here makes the same tensor with the
lean path above and fills the same memos (another 5%, 143 -> 136 ms; :func:`_lean_lift_supported`). Every
``optimizer.step()`` and ``zero_grad()`` opens a profiler range (``torch.ops.profiler._record_function_enter_new``,
no tensor in or out), which PyTorch's mode refuses its cache and walks through its general path before running it:
the mode here runs it at once, as that path ends. An out-of-place foreach op (AdamW's ``_foreach_sqrt`` of the second
moments) is never cached either (its output is a list): PyTorch runs its meta kernel and wraps each output after a
device search per output; with every tensor argument a non-constant fake tensor of this mode on one device, the mode
runs the same kernel and wraps each output the lean way, the converter's memo filled. Both matter where an optimizer
steps once per parameter (the optimizer in backward: a traced step at 5 layers 259 -> 215 ms).

A cache hit is answered with a new fake tensor made from the entry's metadata. PyTorch makes it with a meta tensor
created inside a generator-based context manager and ``FakeTensor(mode, meta, device)``, whose constructor checks
and normalises its arguments and sets a dozen attributes one by one (five of them through descriptors), a quarter of
a traced step. For a strided, non-conjugate, non-negative output with integer sizes and no shape environment, the
mode here takes the same steps with less Python: the same guards (PyTorch's C++ ones, no Python generator), the same
meta ``empty_strided`` (and ``set_`` onto the argument's storage for a view op), the same ``Tensor._make_subclass``
call with the fake device and the same data-pointer flag, and the attributes copied from a prototype that PyTorch's
own constructor made for that device (all of them ``None`` but the device and the mode; checked, and the lean path
is not taken for a device where a prototype differs). A traced step is the same to the byte, about 15% faster
(Llama-2-7B shapes at 5 layers: 184 -> 155 ms); every other output, and a torch without these steps
(:func:`_lean_output_supported`), goes through PyTorch's code.

Where the installed torch has no ``_prep_args_for_hash`` of the shape this overrides, :func:`fake_mode`
returns PyTorch's ``FakeTensorMode``: the same traces, at PyTorch's speed; where it lacks a step the lean hook
takes, the hook is PyTorch's.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from typing import Any

import torch
from torch._subclasses import fake_tensor as _ft
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch as _no_dispatch

#: the parameters of the ``FakeTensorMode._prep_args_for_hash`` this module overrides (torch 2.3 to 2.13)
_EXPECTED = ("self", "result", "args", "state", "id_hashed_objects")
# plain values PyTorch's key takes as (type, value): the types that need no other handling
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Marker:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<memlab quick key>"


MARKER = _Marker()


def supported() -> bool:
    """Whether the installed torch's fake-tensor cache has the key builder :class:`QuickKeyFakeTensorMode`
    overrides (its name and parameters as in torch 2.3 to 2.13)."""
    fn = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    if fn is None:
        return False
    try:
        return tuple(inspect.signature(fn).parameters) == _EXPECTED
    except (TypeError, ValueError):
        return False


def quick_key(t: FakeTensor) -> tuple:
    """The quick key of a strided fake tensor with integer sizes: everything that can differ between two such
    tensors in PyTorch's cache key, in one tuple."""
    return (t.dtype, t.shape, t.stride(), t.device, t.storage_offset(), t.untyped_storage().nbytes(),
            t.requires_grad, t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference())


def _lean_dispatch_supported() -> bool:
    """Whether the installed torch has every step :meth:`QuickKeyFakeTensorMode.__torch_dispatch__` takes in place of
    ``FakeTensorMode.dispatch`` (torch 2.3 to 2.13 have them)."""
    names = ("_DISPATCH_META_HANDLERS", "_DISPATCH_HANDLE_DIRECTLY", "in_kernel_invocation_manager", "log")
    methods = ("dispatch", "_cached_dispatch_impl", "_dispatch_impl")
    return (all(hasattr(_ft, n) for n in names) and all(callable(getattr(FakeTensorMode, m, None)) for m in methods)
            and isinstance(getattr(_ft, "log", None), logging.Logger))


_LEAN = _lean_dispatch_supported()


def _lean_output_supported() -> bool:
    """Whether the installed torch has every step :meth:`QuickKeyFakeTensorMode._get_output_tensor_from_cache_entry`
    takes for a cache hit (torch 2.13 has them; the method's parameters as there)."""
    c = torch._C
    names = ("_DisableTorchDispatch", "_PreserveDispatchKeyGuard", "_set_meta_in_tls_dispatch_include",
             "_meta_in_tls_dispatch_include", "_set_throw_on_mutable_data_ptr", "_set_warn_deprecated_on_mutable_data_ptr")
    fn = getattr(FakeTensorMode, "_get_output_tensor_from_cache_entry", None)
    try:
        params = tuple(inspect.signature(fn).parameters) if fn is not None else ()
    except (TypeError, ValueError):
        params = ()
    return (all(hasattr(c, n) for n in names) and hasattr(_ft, "FakeTensorConfig")
            and hasattr(torch.Tensor, "_make_subclass") and params == ("self", "state", "entry", "key", "func", "args"))


_LEAN_OUTPUT = _lean_output_supported()


def _lean_lift_supported() -> bool:
    """Whether the installed torch's converter from real tensors has the memos the lean ``lift_fresh`` fills (torch
    2.13 has them) and keeps scalars as constants."""
    conv = getattr(_ft, "FakeTensorConverter", None)
    return (_LEAN_OUTPUT and conv is not None and callable(getattr(conv, "add_constant_storage_mapping", None))
            and getattr(_ft, "CONSTANT_NUMEL_LIMIT", 0) >= 1)


_LEAN_LIFT = _lean_lift_supported()
_LIFT = torch.ops.aten.lift_fresh.default
_FOREACH: dict[Any, bool] = {}  # op -> an out-of-place foreach op with a meta kernel (one Tensor[] out)


def _plain_foreach(func: Any) -> bool:
    ok = _FOREACH.get(func)
    if ok is None:
        try:
            schema = func._schema
            ok = (schema.name.startswith("aten::_foreach_") and not schema.is_mutable and len(schema.returns) == 1
                  and schema.returns[0].type == torch._C.ListType.ofTensors() and schema.returns[0].alias_info is None
                  and torch._C._dispatch_has_computed_kernel_for_dispatch_key(schema.name, "Meta"))
        except (AttributeError, RuntimeError):
            ok = False
        _FOREACH[func] = ok
    return ok


_FAKE_KEY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
_ITEM = torch.ops.aten._local_scalar_dense.default
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default


def _profiler_ops() -> frozenset:
    # the record_function ops every optimizer.step() and zero_grad() calls (torch.autograd.profiler.record_function)
    ops = set()
    for packet in ("_record_function_enter_new", "_record_function_exit", "_record_function_enter"):
        p = getattr(torch.ops.profiler, packet, None)
        for name in (getattr(p, "overloads", lambda: [])() if p is not None else []):
            ops.add(getattr(p, name))
    return frozenset(ops)


_PROFILER_OPS = _profiler_ops()


class QuickKeyFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` whose dispatch-cache key of a strided fake tensor input is :func:`quick_key` (the module's
    docstring says why that keys the same ops together as PyTorch's key does), with a leaner dispatch hook."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: TorchDispatchMode leaves this class's __torch_dispatch__ unwrapped (no Dynamo switch per op)
        return False

    def _prototype(self, device: torch.device) -> tuple[torch.device, dict] | None:
        # (the normalised fake device, the attributes PyTorch's constructor gives a new fake tensor on it, less the
        # mode), or None where they are not all None but the device and the mode (this torch sets others: its own
        # constructor then makes every output)
        protos = self.__dict__.setdefault("_memlab_prototypes", {})
        if device not in protos:
            with _ft.in_kernel_invocation_manager(self):
                meta = torch.empty(0, device="meta")
            made = FakeTensor(self, meta, device)
            attrs = {k: v for k, v in made.__dict__.items() if k != "fake_mode"}
            plain = (made.__dict__.get("fake_mode") is self and made.fake_device in attrs.values()
                     and all(v is None or v is made.fake_device for v in attrs.values()))
            protos[device] = (made.fake_device, attrs) if plain else None
        return protos[device]

    def _plain(self) -> bool:
        # the lean paths' common precondition: no shape environment, no fake-tensor debug traces, no export
        return self.shape_env is None and not _ft.FakeTensorConfig.debug and not torch.compiler.is_exporting()

    def _memos(self) -> tuple[Any, Any, Any] | None:
        # (the converter, its meta converter, that one's describer) where they have the memos the lean lift and
        # foreach paths fill, else None
        conv = self.fake_tensor_converter
        mc = getattr(conv, "meta_converter", None)
        describer = getattr(mc, "describer", None)
        ok = (hasattr(describer, "get_tensor_id") and hasattr(describer, "get_storage_id")
              and hasattr(mc, "tensor_memo") and hasattr(mc, "storage_memo"))
        return (conv, mc, describer) if ok else None

    def _wrap(self, meta: torch.Tensor, device: torch.device, attrs: dict) -> FakeTensor:
        # a meta tensor made a fake tensor of this mode on ``device`` (``attrs``: its prototype's, _prototype), with
        # PyTorch's constructor's subclass call and data-pointer flag
        out = torch.Tensor._make_subclass(FakeTensor, meta, meta.requires_grad, dispatch_device=True,
                                          device_for_backend_keys=device)
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
        else:
            torch._C._set_throw_on_mutable_data_ptr(out)
        out.__dict__.update(attrs)
        out.fake_mode = self
        return out

    def _lift_scalar(self, t: torch.Tensor) -> FakeTensor | None:
        # torch.tensor(x) of a 0-dim real CPU tensor: the fake constant PyTorch's lift makes, or None (PyTorch's way)
        if (type(t) is not torch.Tensor or t.dim() != 0 or t.device.type != "cpu" or t.layout is not torch.strided
                or t.requires_grad or t.is_quantized or t.is_conj() or t.is_neg() or not self._plain()
                or getattr(self, "propagate_real_tensors", True)):
            return None
        memos = self._memos()
        proto = self._prototype(t.device) if memos is not None else None
        if proto is None:
            return None
        conv, mc, describer = memos
        device, attrs = proto
        with _no_dispatch():
            const = t.clone()  # as PyTorch keeps it: a copy, the value at the lift
        with _ft.in_kernel_invocation_manager(self):
            meta = torch.empty_strided((), (), dtype=const.dtype, device="meta")
        out = self._wrap(meta, device, attrs)
        out.constant = const
        # the memos PyTorch's converter fills: the clone converts to this tensor again (an in-place op on the constant
        # returns it), a real view of the clone to a view of this storage, and a write invalidates its aliases' constant
        mc.tensor_memo[describer.get_tensor_id(const)] = out
        mc.storage_memo[describer.get_storage_id(const.untyped_storage())] = meta.untyped_storage()
        conv.add_constant_storage_mapping(out)
        return out

    def _foreach(self, func: Any, args: Any, kwargs: Any) -> Any:
        # an out-of-place foreach op on this mode's non-constant fake tensors, all on one device: PyTorch's meta
        # kernel, each output wrapped as PyTorch's converter wraps it (its memo filled); None: PyTorch's way
        if not self._plain() or getattr(self, "propagate_real_tensors", True):
            return None
        device = None
        for a in (*args, *kwargs.values()):
            for t in (a if type(a) in (list, tuple) else (a,)):
                if isinstance(t, torch.Tensor):
                    if not (type(t) is FakeTensor and t.fake_mode is self and t.constant is None
                            and not t._has_symbolic_sizes_strides):
                        return None
                    if device is None:
                        device = t.fake_device
                    elif t.fake_device != device:
                        return None
        if device is None or device.type == "meta":
            return None
        memos = self._memos()
        proto = self._prototype(device) if memos is not None else None
        if proto is None:
            return None
        _, mc, describer = memos
        try:
            with _ft.in_kernel_invocation_manager(self):
                metas = func(*args, **kwargs)
        except NotImplementedError:
            return None
        if not metas:
            return metas
        fake_device, attrs = proto
        out = []
        for meta in metas:
            t = self._wrap(meta, fake_device, attrs)
            mc.tensor_memo[describer.get_tensor_id(meta)] = t
            out.append(t)
        return out

    def _get_output_tensor_from_cache_entry(self, state: Any, entry: Any, key: Any, func: Any, args: Any) -> Any:
        md = entry.metadata
        if (not _LEAN_OUTPUT or entry.inplace_idx is not None or md is None or md.layout is not torch.strided
                or md.is_conj or md.is_neg or md.device.type == "meta" or not self._plain()):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        proto = self._prototype(md.device)
        if proto is None:
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        device, attrs = proto
        # without a shape environment the metadata's sizes, strides and offset are ints (PyTorch's check passes them)
        view = isinstance(func, torch._ops.OpOverload) and func.is_view
        storage = args[entry.view_idx].untyped_storage() if view else None
        c = torch._C
        before = self.in_kernel_invocation
        if c._meta_in_tls_dispatch_include() != before:  # PyTorch's guard, as its context manager checks it
            raise AssertionError(f"{c._meta_in_tls_dispatch_include()}, {before}")
        with c._DisableTorchDispatch(), c._PreserveDispatchKeyGuard():
            self.in_kernel_invocation = True
            c._set_meta_in_tls_dispatch_include(True)
            try:
                meta = torch.empty_strided(md.shape, md.stride, dtype=md.dtype, layout=md.layout, device="meta",
                                           requires_grad=md.requires_grad)
                if view:  # a view op: the argument's storage
                    meta.set_(storage, md.storage_offset, md.shape, md.stride)
            finally:
                self.in_kernel_invocation = before
        return self._wrap(meta, device, attrs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _LEAN or _FAKE_KEY is None:
            return super().__torch_dispatch__(func, types, args, kwargs if kwargs is not None else {})
        if torch._C._get_dispatch_mode(_FAKE_KEY) is not None:  # as PyTorch's hook: never entered from inside
            raise AssertionError(f"FakeTensorMode should not be set when dispatching {func}")
        kwargs = kwargs or {}
        if _ft.log.isEnabledFor(logging.DEBUG):  # PyTorch's own steps, with its debug lines
            return self.dispatch(func, types, args, kwargs)
        if func is _ITEM and len(args) == 1 and not kwargs:
            t = args[0]
            if (type(t) is FakeTensor and t.fake_mode is self and t.constant is not None
                    and not t._has_symbolic_sizes_strides):
                with _no_dispatch():  # the real op on the real constant, as PyTorch's constant propagation runs it
                    return func(t.constant)
        if func in _PROFILER_OPS and not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            # a profiler range opened or closed (no tensor in or out): PyTorch's fake dispatch refuses it the cache
            # (not an aten op) and, its general path walked, runs it as here
            with _ft.in_kernel_invocation_manager(self):
                return func(*args, **kwargs)
        if func is _LIFT and _LEAN_LIFT and len(args) == 1 and not kwargs:
            out = self._lift_scalar(args[0])
            if out is not None:
                return out
        if _LEAN_OUTPUT and _plain_foreach(func):
            out = self._foreach(func, args, kwargs)
            if out is not None:
                return out
        if func is _UNSAFE_VIEW and self.cache_enabled and not kwargs and len(args) == 2:
            t, size = args
            if (type(t) is FakeTensor and t.fake_mode is self and t.constant is None
                    and not t._has_symbolic_sizes_strides and type(size) in (list, tuple)
                    and all(type(n) is int for n in size)):
                # ATen's _unsafe_view is view's computation without the autograd view link (which the layers above
                # this hook make or not by the op's name): the same sizes, strides, offset and storage, or the same
                # refusal. PyTorch's cache refuses to hold it ("unsafe view", its output would get a new storage);
                # the cache entry of view (an alias of the argument's storage) answers it
                return self._cached_dispatch_impl(_VIEW, types, args, kwargs)
        handler = _ft._DISPATCH_META_HANDLERS.get(func)
        if handler is not None:
            return handler(args)
        if func in _ft._DISPATCH_HANDLE_DIRECTLY:
            with _ft.in_kernel_invocation_manager(self):
                return func(*args, **kwargs)
        if self.cache_enabled:
            return self._cached_dispatch_impl(func, types, args, kwargs)
        return self._dispatch_impl(func, types, args, kwargs)

    def _prep_args_for_hash(self, result: list, args: Any, state: Any, id_hashed_objects: list) -> None:
        if isinstance(args, dict):  # PyTorch's walk of a dict: its keys, then its values (each back here)
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        if isinstance(args, (list, tuple)):
            result.append((MARKER, type(args), len(args)))
        strided = torch.strided
        for arg in args:
            if isinstance(arg, FakeTensor):
                if (arg.fake_mode is self and arg.constant is None and arg.layout is strided
                        and not arg._has_symbolic_sizes_strides):
                    result.append(MARKER)
                    result.append(quick_key(arg))
                else:  # PyTorch's key, or its bypass (a constant, another mode's tensor, a sparse one)
                    super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)
            elif isinstance(arg, (list, tuple)):
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            elif isinstance(arg, _PLAIN):
                result.append(type(arg))
                result.append(arg)
            else:  # a real tensor, a symbolic value, a dict, a callable: PyTorch's handling
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)


def fake_mode(**kwargs: Any) -> FakeTensorMode:
    """A :class:`QuickKeyFakeTensorMode` where the installed torch supports it (:func:`supported`), else PyTorch's
    ``FakeTensorMode``; ``kwargs`` go to the mode."""
    return (QuickKeyFakeTensorMode if supported() else FakeTensorMode)(**kwargs)


#: torch.nn.init's in-place initialisers (every one transformers' ``TORCH_INIT_FUNCTIONS`` wraps)
INIT_FUNCTIONS = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
                  "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_")


def _left_as_is(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def no_weight_init():
    """Within the block, ``torch.nn.init``'s initialisers (:data:`INIT_FUNCTIONS`) leave their tensor as it is, and
    so do transformers' guarded copies of them (they call the functions in ``TORCH_INIT_FUNCTIONS``). For a model
    built on fake tensors: an initialiser only writes values into a tensor that exists already, values a trace never
    reads, and skipping them takes about a fifth off a fake build (each parameter's ``kaiming_uniform_`` or
    ``normal_`` dispatched through the fake mode); the storages, their sizes and their order are an initialised
    build's (``tests/ch01/test_fake_mode.py`` traces steps both ways). On leaving, a module first imported inside the
    block that took a stand-in by name (``from torch.nn.init import normal_``, transformers' table) gets torch's
    initialiser back."""
    init = torch.nn.init
    saved = {name: getattr(init, name) for name in INIT_FUNCTIONS if hasattr(init, name)}
    before = set(sys.modules)
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    table_saved = dict(table) if isinstance(table, dict) else {}
    try:
        for name in saved:
            setattr(init, name, _left_as_is)
        if table_saved:
            table.update({name: _left_as_is for name in table_saved if name in saved})
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)
        if table_saved:
            table.update(table_saved)
        for module in [sys.modules[m] for m in set(sys.modules) - before]:
            _give_back(getattr(module, "__dict__", {}), saved)


def _give_back(namespace: dict, saved: dict) -> None:
    # torch's initialisers in place of the stand-in in a module's namespace, and in the dicts it holds (one level)
    for key, value in list(namespace.items()):
        if value is _left_as_is and key in saved:
            namespace[key] = saved[key]
        elif type(value) is dict and any(v is _left_as_is for v in value.values()):
            value.update({k: saved[k] for k, v in value.items() if v is _left_as_is and k in saved})
