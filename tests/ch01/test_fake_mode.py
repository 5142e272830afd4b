"""memlab.estimate.fake_mode: the quick dispatch-cache key keys two fake tensors together exactly when PyTorch's
key does (over drawn sizes, strides, offsets, storages, dtypes and flags), the mode answers ops with the same
cache hits, misses and bypasses as PyTorch's, and a traced step is the same to the byte under either; a fake build
without weight initialisation traces the same step, and every initialiser is given back."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode, extract_tensor_metadata
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.estimate import fake_mode as fm

DTYPES = (torch.float32, torch.bfloat16, torch.complex64, torch.int64)
FIELDS = ("dtype", "storage", "size", "stride", "offset", "requires_grad", "conj", "neg", "inference")


@st.composite
def specs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 3))
    size = tuple(draw(st.integers(0, 4)) for _ in range(ndim))
    stride = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
    reach = sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    offset = draw(st.integers(0, 5))
    storage = reach + offset + 1 + draw(st.integers(0, 3))
    return dict(dtype=dtype, storage=storage, size=size, stride=stride, offset=offset,
                requires_grad=dtype.is_floating_point and draw(st.booleans()),
                conj=dtype.is_complex and draw(st.booleans()), neg=draw(st.booleans()), inference=draw(st.booleans()))


def make(mode, spec):
    """A fake tensor of ``mode`` with the drawn metadata (a view of a storage of ``storage`` elements)."""
    def build():
        base = torch.empty(spec["storage"], dtype=spec["dtype"])
        t = base.as_strided(spec["size"], spec["stride"], spec["offset"])
        if spec["conj"]:
            t = t.conj()
        if spec["neg"]:
            t = torch._neg_view(t)
        return t

    with mode:
        if spec["inference"]:
            with torch.inference_mode():
                t = build()
        else:
            t = build()
        if spec["requires_grad"] and not spec["inference"]:  # an inference tensor takes no grad
            t = t.detach().requires_grad_(True)
    return t


@st.composite
def pairs(draw):
    # a spec and a second one: the same, or with one field drawn again (so equal keys are drawn often)
    a = draw(specs())
    field = draw(st.sampled_from((None,) + FIELDS))
    if field is None:
        return a, dict(a)
    b = dict(a)
    other = draw(specs())
    if field in ("size", "stride"):  # a shape change keeps the view inside the storage
        b.update(size=other["size"], stride=other["stride"], offset=other["offset"], storage=other["storage"])
    elif field == "dtype":
        b.update(dtype=other["dtype"], requires_grad=other["requires_grad"], conj=other["conj"])
    elif field == "requires_grad":
        b["requires_grad"] = a["dtype"].is_floating_point and not a["requires_grad"]
    elif field == "conj":
        b["conj"] = a["dtype"].is_complex and not a["conj"]
    elif field in ("neg", "inference"):
        b[field] = not a[field]
    else:  # storage or offset: inside the storage still
        b[field] = other[field]
        b["storage"] = max(b["storage"], a["storage"] if field == "offset" else 1)
        reach = sum((n - 1) * s for n, s in zip(b["size"], b["stride"])) if all(b["size"]) else 0
        b["storage"] = max(b["storage"], reach + b["offset"] + 1)
    return a, b


def test_supported_here():
    # the installed torch has the key builder the quick mode overrides: the estimator gets the quick mode
    assert fm.supported()
    assert type(fm.fake_mode()) is fm.QuickKeyFakeTensorMode


@settings(max_examples=300, deadline=None)
@given(pairs())
def test_quick_key_equal_exactly_when_torchs_key_is(pair):
    mode = fm.QuickKeyFakeTensorMode()
    a, b = (make(mode, s) for s in pair)
    assert (fm.quick_key(a) == fm.quick_key(b)) == (extract_tensor_metadata(a) == extract_tensor_metadata(b)), pair


def _keys(mode, ops):
    # the cache key each op makes under ``mode`` (None where PyTorch bypasses the cache)
    from torch._subclasses.fake_tensor import _BypassDispatchCache, _CacheKeyState

    out = []
    for func, args, kwargs in ops:
        try:
            out.append(mode._cache_key(_CacheKeyState(mode.shape_env), func, args, kwargs))
        except _BypassDispatchCache as exc:
            out.append(("bypass", exc.reason))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(specs(), min_size=2, max_size=5), st.integers(0, 3))
def test_ops_share_a_key_exactly_as_under_torchs(spec_list, alpha):
    # ops on the drawn tensors (tensor lists, scalars, keywords, a real tensor, a constant): two ops share a quick
    # key exactly when they share PyTorch's, and each bypass is PyTorch's
    aten = torch.ops.aten

    def ops(mode):
        ts = [make(mode, s) for s in spec_list]
        with mode:
            const = torch.tensor(2.0)  # a constant: bypassed by both
        real = torch.zeros(2)  # not a fake tensor: bypassed by both
        return [(aten.clone.default, (t,), {}) for t in ts] + \
            [(aten.add.Tensor, (t, u), {"alpha": alpha}) for t, u in zip(ts, ts[1:])] + \
            [(aten._foreach_mul.Scalar, (ts, 0.5), {}), (aten._foreach_mul.Scalar, (ts[::-1], 0.5), {}),
             (aten.mul.Tensor, (ts[0], const), {}), (aten.mul.Tensor, (ts[0], real), {})]

    quick_mode, plain_mode = fm.QuickKeyFakeTensorMode(), FakeTensorMode()
    quick, plain = _keys(quick_mode, ops(quick_mode)), _keys(plain_mode, ops(plain_mode))
    n = len(quick)
    bypasses = [[k if isinstance(k, tuple) else "key" for k in keys] for keys in (quick, plain)]
    assert bypasses[0] == bypasses[1] and bypasses[0][-2:] == [("bypass", "constant attribute"),
                                                               ("bypass", "non-fake tensor")]
    same_quick = [[quick[i] == quick[j] for j in range(n)] for i in range(n)]
    same_plain = [[plain[i] == plain[j] for j in range(n)] for i in range(n)]
    assert same_quick == same_plain


def test_falls_back_to_torchs_mode_where_the_key_builder_differs(monkeypatch):
    def other(self, result, args):  # a torch whose key builder takes other parameters
        raise AssertionError("not called")

    monkeypatch.setattr(FakeTensorMode, "_prep_args_for_hash", other)
    assert not fm.supported()
    assert type(fm.fake_mode()) is FakeTensorMode


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=4), st.sampled_from(DTYPES[:3]))
def test_the_lean_hook_answers_ops_as_torchs_mode(values, dtype):
    # constants and their .item() (answered before the cache), in-place ops on them, a fake tensor without a constant
    # (its .item() refused alike), the foreach ops an optimizer runs: the same values, metadata and errors as PyTorch's
    def run(mode):
        out = []
        with mode:
            steps = [torch.tensor(v, dtype=dtype) for v in values]
            torch._foreach_add_(steps, 1)
            out += [s.item() for s in steps]
            x = torch.empty(len(values), 3, dtype=dtype)
            ys = torch._foreach_mul([x, x.t()], 0.5)
            out += [(y.shape, y.stride(), y.dtype, y.constant is None) for y in ys]
            try:
                x.sum().item()
            except Exception as exc:  # a data-dependent value: both refuse it the same way
                out.append(type(exc).__name__)
        return out

    assert fm._LEAN
    assert run(fm.QuickKeyFakeTensorMode()) == run(FakeTensorMode())


def _described(t):
    # everything a fake tensor made for a cache hit shows: metadata, autograd flags, dispatch keys, its attributes
    return (type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad, t.is_leaf,
            t.untyped_storage().nbytes(), t._version, str(torch._C._dispatch_keys(t)),
            sorted((k, v) for k, v in t.__dict__.items() if k != "fake_mode"), t.fake_mode is not None)


def _hits(mode, spec, scalar):
    # each op run twice on the drawn tensor (a miss, then the cache hit the lean output path answers); for a view op,
    # whether the output shares its argument's storage
    aten = torch.ops.aten
    out = []
    x = make(mode, spec)
    with mode:
        ops = [lambda: x.clone(), lambda: x * scalar, lambda: x.unsqueeze(0), lambda: x.reshape(-1) if x.numel() else
               x.clone(), lambda: x.detach(), lambda: aten.alias.default(x),
               lambda: torch.empty_strided((2, 3), (1, 2), dtype=spec["dtype"], requires_grad=spec["requires_grad"])]
        for op in ops:
            for _ in range(2):
                y = op()
                out.append(_described(y))
                out.append(y.untyped_storage()._cdata == x.untyped_storage()._cdata)
    return out


@settings(max_examples=60, deadline=None)
@given(specs(), st.sampled_from([2.0, 0.5, -1.0]))
def test_a_cache_hit_makes_the_fake_tensor_torchs_mode_makes(spec, scalar):
    # the lean output path (the prototype's attributes, the same subclass call) against PyTorch's constructor,
    # over drawn sizes, strides, offsets, dtypes and flags (conjugate and negative ones go PyTorch's way)
    assert fm._LEAN_OUTPUT
    quick, plain = fm.QuickKeyFakeTensorMode(), FakeTensorMode()
    assert _hits(quick, spec, scalar) == _hits(plain, spec, scalar)
    assert quick._memlab_prototypes.get(torch.device("cpu")) is not None  # the lean path made the quick mode's hits


@settings(max_examples=80, deadline=None)
@given(specs(), st.sampled_from([[-1], [1, -1], [-1, 1], [2, -1], [-1, 2, 1], [0, -1], [3]]))
def test_unsafe_view_is_answered_as_torchs_mode_answers_it(spec, size):
    # _unsafe_view answered from view's cache entry: the same sizes, strides, offset, the argument's storage, or the
    # same refusal (a size that does not divide, strides that cannot be viewed), as PyTorch's mode answers it
    aten = torch.ops.aten

    def run(mode):
        x = make(mode, spec)
        out = []
        with mode:
            for _ in range(2):  # the second from the cache
                try:
                    y = aten._unsafe_view.default(x, size)
                except Exception as exc:
                    out.append(type(exc).__name__)
                    continue
                out.append(_described(y))
                out.append((y._base is None, y.untyped_storage()._cdata == x.untyped_storage()._cdata))
        return out

    assert run(fm.QuickKeyFakeTensorMode()) == run(FakeTensorMode())


class _Seen(TorchDispatchMode):
    # a mode above the fake mode: whether each op's output is its first argument, as the fake mode returned it
    def __init__(self):
        super().__init__()
        self.same = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.same.append(out is args[0])
        return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.bool]),
       st.integers(-5, 5), st.sampled_from(["add_", "view", "mul", "write", "item", "twice"]))
def test_a_lifted_scalar_behaves_as_under_torchs_mode(dtype, value, then):
    # torch.tensor(value) lifted by the lean path against PyTorch's converter: the fake tensor, its constant, and what
    # its memos decide afterwards (an in-place op on it returns it with the new constant, a view shares its storage
    # and constant, a write of a non-constant drops the constant of it and of its views, item() reads it)
    from torch.utils._mode_utils import no_dispatch

    def const(t):  # the constant's value, read outside the mode
        if t.constant is None:
            return None
        with no_dispatch():
            return t.constant.item(), t.constant.dtype

    def run(mode):
        with mode:
            x = torch.tensor(value, dtype=dtype)
            out = [_described(x), const(x)]
            if then == "add_" and dtype != torch.bool:
                with _Seen() as seen:  # what the mode hands the layers above (a tracker): the argument itself
                    y = x.add_(1)
                out += [y is x, seen.same, const(x), x.item()]
            elif then == "view":
                v = x.view(1)
                out += [v.untyped_storage()._cdata == x.untyped_storage()._cdata, const(v), _described(v)]
            elif then == "mul" and dtype != torch.bool:
                z = x * 3
                out += [const(z), _described(z)]
            elif then == "write":
                v = x.view(1)
                x.copy_(torch.empty((), dtype=dtype))  # a fake tensor without a constant: the value is unknown
                out += [x.constant is None, v.constant is None]
            elif then == "item":
                out += [x.item(), type(x.item())]
            else:
                x2 = torch.tensor(value, dtype=dtype)
                out += [x2 is x, x2.untyped_storage()._cdata == x.untyped_storage()._cdata, _described(x2)]
        return out

    assert fm._LEAN_LIFT
    quick = fm.QuickKeyFakeTensorMode()
    assert run(quick) == run(FakeTensorMode())
    assert quick._memlab_prototypes.get(torch.device("cpu")) is not None


@settings(max_examples=40, deadline=None)
@given(st.lists(specs(), min_size=1, max_size=4), st.sampled_from(["sqrt", "mul", "add_list", "norm", "const"]))
def test_out_of_place_foreach_ops_as_under_torchs_mode(spec_list, kind):
    # an out-of-place foreach op (the lean path: PyTorch's meta kernel, each output wrapped lean) against PyTorch's
    # mode: the same outputs (metadata, attributes, a storage of their own) or the same refusal; a list holding a
    # constant goes PyTorch's way
    floats = [dict(sp, dtype=torch.float32, conj=False) for sp in spec_list]

    def run(mode):
        xs = [make(mode, sp) for sp in floats]
        out = []
        with mode:
            for _ in range(2):
                try:
                    if kind == "sqrt":
                        ys = torch._foreach_sqrt(xs)
                    elif kind == "mul":
                        ys = torch._foreach_mul(xs, 0.5)
                    elif kind == "add_list":
                        ys = torch._foreach_add(xs, xs[::-1] if all(x.shape == xs[0].shape for x in xs) else xs)
                    elif kind == "norm":
                        ys = torch._foreach_norm(xs)
                    else:
                        ys = torch._foreach_mul([*xs, torch.tensor(2.0)], 3.0)
                except Exception as exc:
                    out.append(type(exc).__name__)
                    continue
                out.append([_described(y) for y in ys])
                ins = {x.untyped_storage()._cdata for x in xs}
                out.append([y.untyped_storage()._cdata in ins for y in ys])
        return out

    assert run(fm.QuickKeyFakeTensorMode()) == run(FakeTensorMode())


def test_a_profiler_range_runs_inside_the_mode():
    # optimizer.step() and zero_grad() open a profiler range: answered without the fake path, it still nests and
    # shows in a profile of the block
    from torch.profiler import ProfilerActivity, profile, record_function

    mode = fm.QuickKeyFakeTensorMode()
    with profile(activities=[ProfilerActivity.CPU]) as prof, mode:
        with record_function("memlab-range"):
            torch.empty(3) * 2
    assert any(e.name == "memlab-range" for e in prof.events())


def test_a_constructor_that_sets_more_leaves_every_output_to_torch(monkeypatch):
    # where PyTorch's constructor gives a new fake tensor an attribute the prototype check does not know, the lean
    # path is not taken for that device: every output is PyTorch's own (its attribute there)
    from torch._subclasses.fake_tensor import FakeTensor

    real_new = FakeTensor.__new__

    def new(cls, *a, **k):
        t = real_new(cls, *a, **k)
        t.memlab_test_mark = object()
        return t

    monkeypatch.setattr(FakeTensor, "__new__", new)
    mode = fm.QuickKeyFakeTensorMode()
    with mode:
        x = torch.empty(4)
        ys = [x * 2 for _ in range(3)]  # the second and third: cache hits
    assert all(hasattr(y, "memlab_test_mark") for y in ys)
    assert mode._memlab_prototypes == {torch.device("cpu"): None}


def test_the_lean_hook_takes_torchs_steps_at_debug_level(monkeypatch):
    # with PyTorch's fake-tensor logger at debug level the hook goes through FakeTensorMode.dispatch (its log lines);
    # otherwise it does not
    import logging

    from torch._subclasses import fake_tensor as ft

    calls = []
    real = FakeTensorMode.dispatch

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    mode = fm.QuickKeyFakeTensorMode()
    with mode:
        torch.empty(3) + 1
    assert calls == []
    monkeypatch.setattr(ft.log, "level", logging.DEBUG)
    monkeypatch.setattr(ft.log, "disabled", False)
    ft.log.manager._clear_cache()
    with mode:
        torch.empty(3) + 1
        n = len(calls)
        torch.tensor(2.0).item()  # the lifted scalar and its item(): PyTorch's steps too at debug level
    ft.log.manager._clear_cache()
    assert n >= 2 and len(calls) >= n + 2


@pytest.mark.parametrize("kw", [dict(), dict(checkpointing=True, adapter="lora", optimizer="adamw8bit"),
                                dict(adapter="qlora", loss="chunked")], ids=["full", "lora-ckpt-8bit", "qlora-chunked"])
def test_a_trace_is_the_same_under_torchs_mode(monkeypatch, kw):
    # every moment of a traced step (its phase, its bytes by category) and the caching allocator's replay, under the
    # quick mode and under PyTorch's own
    from transformers import LlamaConfig

    from memlab.estimate.api import make_step, resolve_for_step
    from memlab.estimate.trace import trace_step

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)

    def traced():
        step = make_step(None, batch_size=2, seq_len=32, device="cuda", **kw)
        est = trace_step(resolve_for_step(config, step), step)
        return ([(ev.phase, dict(ev.bytes)) for ev in est.tracker.timeline], est.peak_bytes, est.reserved_replay_bytes,
                est.phase_breakdowns, est.breakdown_end)

    quick = traced()
    monkeypatch.setattr(fm, "supported", lambda: False)
    plain = traced()
    assert len(quick[0]) > 50 and quick == plain


def _traced(model, **kw):
    # every moment of a traced step, its peak, its replayed reserved bytes, its phase breakdowns
    from memlab.estimate.api import make_step, resolve_for_step
    from memlab.estimate.trace import trace_step

    step = make_step(None, batch_size=2, seq_len=32, device="cuda", **kw)
    est = trace_step(resolve_for_step(model, step), step)
    return ([(ev.phase, dict(ev.bytes)) for ev in est.tracker.timeline], est.peak_bytes, est.reserved_replay_bytes,
            est.phase_breakdowns, est.breakdown_end, est.n_params)


@pytest.mark.parametrize("model,kw", [
    ("llama", dict()), ("llama", dict(adapter="lora", checkpointing=True)), ("llama", dict(adapter="qlora")),
    ("gpt2", dict(dtype="fp32")), ("tinygpt", dict())], ids=["llama", "llama-lora-ckpt", "llama-qlora", "gpt2-tied",
                                                             "tinygpt-factory"])
def test_a_build_without_weight_init_traces_the_same_step(monkeypatch, model, kw):
    # the fake build skips the initialisers (no_weight_init); with them run, every moment is the same (tied weights
    # stay tied: GPT-2's head and embedding; memlab's own TinyGPT built by a factory)
    import contextlib

    from transformers import GPT2Config, LlamaConfig

    from memlab.models import TinyGPT, TinyGPTConfig

    models = {"llama": LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=128),
              "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128),
              "tinygpt": lambda: TinyGPT(TinyGPTConfig(n_layer=2, n_embd=64, dropout=0.1))}
    skipped = _traced(models[model], **kw)
    from memlab.estimate import trace

    assert trace.no_weight_init is fm.no_weight_init  # the build's, replaced below
    monkeypatch.setattr(trace, "no_weight_init", contextlib.nullcontext)
    assert _traced(models[model], **kw) == skipped


def test_no_weight_init_leaves_values_and_gives_every_initialiser_back(tmp_path, monkeypatch):
    import importlib
    import sys

    originals = {name: getattr(torch.nn.init, name) for name in fm.INIT_FUNCTIONS}
    (tmp_path / "memlab_probe_init.py").write_text("from torch.nn.init import normal_, kaiming_uniform_\n"
                                                   "TABLE = {'zeros_': __import__('torch').nn.init.zeros_}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    t = torch.arange(6.0)
    with fm.no_weight_init():
        assert torch.nn.init.normal_(t) is t and torch.nn.init.kaiming_uniform_(t.view(2, 3)).data_ptr() == t.data_ptr()
        probe = importlib.import_module("memlab_probe_init")  # first imported inside: takes the stand-ins by name
        assert probe.normal_ is not originals["normal_"]
    assert torch.equal(t, torch.arange(6.0))  # nothing was written
    assert {name: getattr(torch.nn.init, name) for name in fm.INIT_FUNCTIONS} == originals
    assert probe.normal_ is originals["normal_"] and probe.kaiming_uniform_ is originals["kaiming_uniform_"]
    assert probe.TABLE["zeros_"] is originals["zeros_"]
    hf = sys.modules.get("transformers.initialization")
    if hf is not None:
        assert all(hf.TORCH_INIT_FUNCTIONS[n] is originals[n] for n in hf.TORCH_INIT_FUNCTIONS if n in originals)
    sys.modules.pop("memlab_probe_init", None)
