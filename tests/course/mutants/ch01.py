"""Plausible wrong answers to chapter 01's exercises; tests/course/test_mutants.py asserts each FAILS."""
from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memlab.models import TinyGPT, lm_loss


# ----------------------------------------------------------------------------- 01.live_bytes
class _LiveBase:
    def __init__(self):
        self.current = 0
        self.peak = 0
        self._refs = {}

    def _add(self, key, obj, n):
        def free(ref, key=key, n=n):
            if self._refs.get(key) is ref:
                del self._refs[key]
                self.current -= n
        self._refs[key] = weakref.ref(obj, free)
        self.current += n
        self.peak = max(self.peak, self.current)


class LiveNoDedup(_LiveBase):
    """Every track() adds bytes, even for a storage already tracked."""
    def track(self, t):
        st = t.untyped_storage()
        self._add(object(), st, st.nbytes())


class LiveViewBytes(_LiveBase):
    """Counts the view's own elements, not its storage."""
    def track(self, t):
        key = t.untyped_storage()._cdata
        if key not in self._refs:
            self._add(key, t.untyped_storage(), t.numel() * t.element_size())


class LiveWeakrefOnTensor(_LiveBase):
    """Watches the tensor object: frees the bytes when a view dies though its storage lives on."""
    def track(self, t):
        key = t.untyped_storage()._cdata
        if key not in self._refs:
            self._add(key, t, t.untyped_storage().nbytes())


class LiveNoPeak(_LiveBase):
    """Never updates the peak after a free (peak = current)."""
    def track(self, t):
        key = t.untyped_storage()._cdata
        if key not in self._refs:
            self._add(key, t.untyped_storage(), t.untyped_storage().nbytes())
        self.peak = self.current

    def __getattribute__(self, name):
        if name == "peak":
            return object.__getattribute__(self, "current")
        return object.__getattribute__(self, name)


class LivePerTensor:
    """Adds every tracked tensor's own bytes (views counted again) and never subtracts."""
    def __init__(self):
        self.current = self.peak = 0

    def track(self, t):
        self.current += t.numel() * t.element_size()
        self.peak = max(self.peak, self.current)


class LiveNoFinalizer:
    """Counts each storage once (by data_ptr) but gives nothing back when it dies."""
    def __init__(self):
        self.current = self.peak = 0
        self.seen = set()

    def track(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.seen:
            self.seen.add(st.data_ptr())
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)


class LiveFinalizeTensor:
    """Keyed by data_ptr, with weakref.finalize on the tensor: a dead view frees a live storage."""
    def __init__(self):
        self.current = self.peak = 0
        self.seen = {}

    def track(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.seen:
            return
        n = st.nbytes()

        def free(key=key, n=n):
            self.seen.pop(key, None)
            self.current -= n

        self.seen[key] = weakref.finalize(t, free)
        self.current += n
        self.peak = max(self.peak, self.current)


# ----------------------------------------------------------------------------- 01.categorize
_BORN = {"forward": "activations", "backward": "activations", "optimizer": "optimizer", "other": "other"}


def _params(model, optimizer, buffers=True):
    ps = list(model.parameters()) if model is not None else []
    if model is not None and buffers:
        ps += list(model.buffers())
    if optimizer is not None:
        ps += [p for g in optimizer.param_groups for p in g["params"]]
    return ps


def _owner(t, model, optimizer, same=None, buffers=True, state=lambda k: True):
    """The owner of t's storage ('parameters', 'gradients', 'optimizer') or None; the knobs make mutants."""
    if same is None:
        key = t.untyped_storage()._cdata
        same = lambda x: isinstance(x, torch.Tensor) and x.untyped_storage()._cdata == key  # noqa: E731
    ps = _params(model, optimizer, buffers)
    if any(same(p) for p in ps):
        return "parameters"
    if any(same(p.grad) for p in ps):
        return "gradients"
    if optimizer is not None and any(same(v) for s in optimizer.state.values() for k, v in s.items() if state(k)):
        return "optimizer"
    return None


def categorize_grad_fn_rule(t, model=None, optimizer=None, phase=None):
    """The old shortcut: owners, then grad_fn -> activations, else other; the phase is ignored,
    so dropout masks, LayerNorm statistics and activation gradients come out 'other'."""
    return _owner(t, model, optimizer) or ("activations" if t.grad_fn is not None else "other")


def categorize_phase_first(t, model=None, optimizer=None, phase=None):
    """Asks the phase before the owner: a weight used in forward becomes 'activations'."""
    if phase in ("forward", "backward"):
        return "activations"
    return _owner(t, model, optimizer) or _BORN[phase]


def categorize_optimizer_temps_other(t, model=None, optimizer=None, phase=None):
    """Only optimizer.state is 'optimizer': the step's temporaries (Adam's denominator) become 'other'."""
    return _owner(t, model, optimizer) or ("other" if phase == "optimizer" else _BORN[phase])


def categorize_backward_is_gradients(t, model=None, optimizer=None, phase=None):
    """Everything born in backward is a gradient: activation gradients become 'gradients'."""
    return _owner(t, model, optimizer) or ("gradients" if phase == "backward" else _BORN[phase])


def categorize_by_identity(t, model=None, optimizer=None, phase=None):
    """Compares tensor objects (``is``), not storages: a detached or viewed weight is missed."""
    return _owner(t, model, optimizer, same=lambda x: x is t) or _BORN[phase]


def categorize_without_buffers(t, model=None, optimizer=None, phase=None):
    """Forgets model.buffers(): BatchNorm's running statistics go by their phase."""
    return _owner(t, model, optimizer, buffers=False) or _BORN[phase]


def categorize_moments_only(t, model=None, optimizer=None, phase=None):
    """Only exp_avg / exp_avg_sq are optimizer state; the step counter goes by its phase."""
    return _owner(t, model, optimizer, state=lambda k: k.startswith("exp_avg")) or _BORN[phase]


def categorize_requires_grad_first(t, model=None, optimizer=None, phase=None):
    """'Needs a gradient' taken for 'is an activation', before asking the owner: weights fail."""
    if t.requires_grad:
        return "activations"
    return _owner(t, model, optimizer) or _BORN[phase]


# ----------------------------------------------------------------------------- 01.phase_peaks
def sum_of_category_peaks(timeline):
    """Adds each category's own peak: categories peak at different moments, so this overshoots."""
    out: dict = {}
    for _, phase, by_cat in timeline:
        cur = out.setdefault(phase, {})
        for k, v in by_cat.items():
            cur[k] = max(cur.get(k, 0), v)
    return {p: sum(c.values()) for p, c in out.items()}


def last_event_per_phase(timeline):
    out = {}
    for _, phase, by_cat in timeline:
        out[phase] = sum(by_cat.values())
    return out


def first_event_per_phase(timeline):
    out = {}
    for _, phase, by_cat in timeline:
        out.setdefault(phase, sum(by_cat.values()))
    return out


def activations_only(timeline):
    out = {}
    for _, phase, by_cat in timeline:
        out[phase] = max(out.get(phase, 0), by_cat.get("activations", 0))
    return out


# ----------------------------------------------------------------------------- 01.fake_activations
def _fake(config, batch_size, seq_len, *, skip_params=True, dedup=True, view_bytes=False):
    with FakeTensorMode():
        model = TinyGPT(config)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        y = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        skip = {id(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())} if skip_params else set()
        seen: dict = {}
        total = [0]

        def pack(t):
            st = t.untyped_storage()
            if id(st) in skip:
                return t
            n = t.numel() * t.element_size() if view_bytes else st.nbytes()
            if dedup:
                seen[id(st)] = n
            else:
                total[0] += n
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, y)
        return int(sum(seen.values()) + total[0])


def fake_counts_weights(config, batch_size, seq_len):
    return _fake(config, batch_size, seq_len, skip_params=False)


def fake_no_dedup(config, batch_size, seq_len):
    return _fake(config, batch_size, seq_len, dedup=False)


def fake_view_bytes(config, batch_size, seq_len):
    return _fake(config, batch_size, seq_len, view_bytes=True)


def fake_forward_only_logits(config, batch_size, seq_len):
    """Saves of the forward without the loss (model(x) instead of model(x, y))."""
    with FakeTensorMode():
        model = TinyGPT(config)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        skip = {id(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())}
        seen: dict = {}

        def pack(t):
            if id(t.untyped_storage()) not in skip:
                seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        return int(sum(seen.values()))


def fake_keyed_by_data_ptr(config, batch_size, seq_len):
    """Dedup by data_ptr(), which means nothing on fake tensors: storages collide."""
    import warnings

    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        model = TinyGPT(config)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        y = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        skip = {p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(model.buffers())}
        seen: dict = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in skip:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, y)
        return int(sum(seen.values()))


# ----------------------------------------------------------------------------- 01.fix_the_leak
def train_keeps_tensors(model, opt, batches, steps):
    """The classic leak: history of loss tensors, each keeping its graph."""
    history, it = [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(loss)
    return history


def train_no_zero_grad(model, opt, batches, steps):
    """Floats returned, but gradients accumulate across steps: other losses."""
    history, it = [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        history.append(loss.item())
    return history


_KEEP: list = []


def train_hidden_leak(model, opt, batches, steps):
    """Returns floats but stashes every loss tensor (and its graph) in a module-level list."""
    history, it = [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
        _KEEP.append(loss)
        history.append(loss.item())
    return history


def train_detached_tensors(model, opt, batches, steps):
    """loss.detach(): no graph kept, but still tensors, not floats."""
    history, it = [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(loss.detach())
    return history


def train_retained_history(model, opt, batches, steps):
    """The lab's buggy loop: loss tensors in the history, each graph retained."""
    history, it = [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        history.append(loss)
        loss.backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
    return history


def train_floats_kept_on_function(model, opt, batches, steps):
    """Returns floats, but parks the loss tensors (graphs retained) on a function attribute."""
    history, kept, it = [], [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
        kept.append(loss)
        history.append(loss.item())
    train_floats_kept_on_function.kept = kept
    return history


MUTANTS = {
    "01.live_bytes": [
        ("no dedup of a storage tracked twice", LiveNoDedup),
        ("bytes of the view, not of the storage", LiveViewBytes),
        ("weakref on the tensor, not the storage", LiveWeakrefOnTensor),
        ("peak follows current", LiveNoPeak),
        ("bytes per tensor, never subtracted", LivePerTensor),
        ("no finalizer", LiveNoFinalizer),
        ("weakref.finalize on the tensor, keyed by data_ptr", LiveFinalizeTensor),
    ],
    "01.categorize": [
        ("grad_fn rule, phase ignored", categorize_grad_fn_rule),
        ("phase first, owners ignored", categorize_phase_first),
        ("optimizer-phase temporaries as other", categorize_optimizer_temps_other),
        ("backward-born tensors as gradients", categorize_backward_is_gradients),
        ("tensor identity (is) instead of the same storage", categorize_by_identity),
        ("buffers not counted as parameters", categorize_without_buffers),
        ("step counter not optimizer state", categorize_moments_only),
        ("requires_grad means activation", categorize_requires_grad_first),
    ],
    "01.phase_peaks": [
        ("sum of per-category peaks", sum_of_category_peaks),
        ("last event of each phase", last_event_per_phase),
        ("first event of each phase", first_event_per_phase),
        ("activations only", activations_only),
    ],
    "01.fake_activations": [
        ("weights counted as activations", fake_counts_weights),
        ("no storage dedup", fake_no_dedup),
        ("bytes of views, not storages", fake_view_bytes),
        ("forward without the loss", fake_forward_only_logits),
        ("storages keyed by data_ptr on fake tensors", fake_keyed_by_data_ptr),
    ],
    "01.fix_the_leak": [
        ("history of loss tensors", train_keeps_tensors),
        ("no zero_grad", train_no_zero_grad),
        ("a hidden list of losses with retained graphs", train_hidden_leak),
        ("detached tensors instead of floats", train_detached_tensors),
        ("loss tensors in the history, graphs retained", train_retained_history),
        ("floats returned, tensors kept on the function", train_floats_kept_on_function),
    ],
}


# ----------------------------------------------------------------------------- issue 24: new wrong answers
class LiveKeyedByTensorDataPtr(_LiveBase):
    """Keys by the tensor's data_ptr() (offset included): a view at an offset is another storage."""
    def track(self, t):
        key = t.data_ptr()
        if key not in self._refs:
            st = t.untyped_storage()
            self._add(key, st, st.nbytes())


class LiveNeverForgets:
    """Keys by the storage's address and gives the bytes back when it dies, but never forgets the
    address: a new storage made where a dead one was is taken for the old one."""
    def __init__(self):
        self.current = self.peak = 0
        self.seen = set()
        self._refs = []

    def track(self, t):
        st = t.untyped_storage()
        if st.data_ptr() in self.seen:
            return
        self.seen.add(st.data_ptr())
        n = st.nbytes()

        def free(_ref, n=n):
            self.current -= n

        self._refs.append(weakref.ref(st, free))
        self.current += n
        self.peak = max(self.peak, self.current)


class LiveOffsetToEnd(_LiveBase):
    """Keys by storage, but counts a view from its offset to the end of the storage (first seen wins)."""
    def track(self, t):
        st = t.untyped_storage()
        if st._cdata not in self._refs:
            self._add(st._cdata, st, st.nbytes() - t.storage_offset() * t.element_size())


def _owner_by(t, model, optimizer, ptr):
    key = ptr(t)
    same = lambda x: isinstance(x, torch.Tensor) and ptr(x) == key  # noqa: E731
    return _owner(t, model, optimizer, same=same)


def categorize_tensor_data_ptr(t, model=None, optimizer=None, phase=None):
    """Compares tensors' data_ptr() (offsets included): a view at an offset of a weight is missed."""
    return _owner_by(t, model, optimizer, lambda x: x.data_ptr()) or _BORN[phase]


def categorize_state_by_tensor_ptr(t, model=None, optimizer=None, phase=None):
    """Storages for parameters and gradients, but tensor data_ptr() for optimizer state."""
    own = _owner(t, model, optimizer)
    if own in ("parameters", "gradients"):
        return own
    if optimizer is not None and any(isinstance(v, torch.Tensor) and v.data_ptr() == t.data_ptr()
                                     for s in optimizer.state.values() for v in s.values()):
        return "optimizer"
    return _BORN[phase]


def categorize_start_of_tensor(t, model=None, optimizer=None, phase=None):
    """Matches t when it starts where an owner starts (t.data_ptr() == owner's storage address)."""
    return _owner_by(t, model, optimizer, lambda x: x.data_ptr() if x is t else x.untyped_storage().data_ptr()) \
        or _BORN[phase]


def train_running_total(model, opt, batches, steps):
    """Floats in the history, and a running `total = total + loss`: every step's graph stays alive."""
    history, total, it = [], 0.0, iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = total + loss
        history.append(loss.item())
    return history


def train_last_loss_on_optimizer(model, opt, batches, steps):
    """Parks the last loss tensor on the optimizer (for logging): its graph outlives the loop."""
    history, it = [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt.last_loss = loss
        history.append(loss.item())
    return history


def train_numpy_floats(model, opt, batches, steps):
    """loss.detach().numpy(): numbers, but numpy's, not Python floats."""
    history, it = [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(loss.detach().numpy()[()])
    return history


MUTANTS["01.live_bytes"] += [
    ("keyed by the tensor's data_ptr()", LiveKeyedByTensorDataPtr),
    ("a dead storage's address never forgotten", LiveNeverForgets),
    ("a view counted from its offset to the end", LiveOffsetToEnd),
]
MUTANTS["01.categorize"] += [
    ("tensors compared by data_ptr()", categorize_tensor_data_ptr),
    ("optimizer state compared by data_ptr()", categorize_state_by_tensor_ptr),
    ("t's data_ptr() against owners' storage addresses", categorize_start_of_tensor),
]
MUTANTS["01.fix_the_leak"] += [
    ("a running total = total + loss", train_running_total),
    ("the last loss kept on the optimizer", train_last_loss_on_optimizer),
    ("numpy floats", train_numpy_floats),
]


def peaks_numpy(timeline):
    """Right peaks, as numpy ints."""
    import numpy as np

    out = {}
    for _, phase, by_cat in timeline:
        out[phase] = max(out.get(phase, 0), sum(by_cat.values()))
    return {p: np.int64(v) for p, v in out.items()}


def peaks_without_other(timeline):
    """Leaves the 'other' category (inputs, temporaries) out of the total."""
    out = {}
    for _, phase, by_cat in timeline:
        out[phase] = max(out.get(phase, 0), sum(v for k, v in by_cat.items() if k != "other"))
    return out


def peaks_of_changes(timeline):
    """The largest step between two events of a phase, not the largest total."""
    out, prev = {}, 0
    for _, phase, by_cat in timeline:
        tot = sum(by_cat.values())
        out[phase] = max(out.get(phase, 0), tot - prev)
        prev = tot
    return out


def fake_fp32_elements(config, batch_size, seq_len):
    """numel * 4 for every saved storage: the int64 token ids and targets are 8 bytes an element."""
    with FakeTensorMode():
        model = TinyGPT(config)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        y = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        skip = {id(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())}
        seen: dict = {}

        def pack(t):
            st = t.untyped_storage()
            if id(st) not in skip:
                seen[id(st)] = st.nbytes() // t.element_size() * 4
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, y)
        return int(sum(seen.values()))


def fake_float(config, batch_size, seq_len):
    """Right count, as a float."""
    return float(_fake(config, batch_size, seq_len))


def fake_no_grad(config, batch_size, seq_len):
    """Runs the fake forward under no_grad: nothing is saved."""
    with torch.no_grad():
        return _fake(config, batch_size, seq_len)


MUTANTS["01.phase_peaks"] += [
    ("numpy ints", peaks_numpy),
    ("the 'other' category left out", peaks_without_other),
    ("largest change, not largest total", peaks_of_changes),
]
MUTANTS["01.fake_activations"] += [
    ("4 bytes for every element", fake_fp32_elements),
    ("a float", fake_float),
    ("forward under no_grad", fake_no_grad),
]


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
def peaks_every_phase(timeline):
    """Reports all four phases, 0 for a phase the timeline never enters (every graded timeline has all four)."""
    from memlab.course.reference.ch01 import PHASES, phase_peaks

    return {p: phase_peaks(timeline).get(p, 0) for p in PHASES} if timeline else {}


def peaks_sorts_the_timeline(timeline):
    """Sorts the caller's timeline by phase in place to group the events."""
    from memlab.course.reference.ch01 import phase_peaks

    out = phase_peaks(timeline)
    timeline.sort(key=lambda e: e.phase)
    return out


MUTANTS["01.phase_peaks"] += [
    ("every phase reported, 0 when absent", peaks_every_phase),
    ("sorts the caller's timeline in place", peaks_sorts_the_timeline),
]


class LiveBytesClassRegistry:
    """A right counter, except that the weak references live in one registry on the class ("every counter sees
    every storage"): a second counter finds the first one's storages already counted."""

    registry: dict = {}

    def __init__(self):
        self.current = 0
        self.peak = 0

    def track(self, t):
        import weakref

        st = t.untyped_storage()
        key = st._cdata
        if key in LiveBytesClassRegistry.registry and LiveBytesClassRegistry.registry[key]() is st:
            return
        n = st.nbytes()

        def free(ref, key=key, n=n):
            if LiveBytesClassRegistry.registry.get(key) is ref:
                del LiveBytesClassRegistry.registry[key]
                self.current -= n

        LiveBytesClassRegistry.registry[key] = weakref.ref(st, free)
        self.current += n
        self.peak = max(self.peak, self.current)


MUTANTS["01.live_bytes"] += [("weak references in a registry on the class", LiveBytesClassRegistry)]


# ----------------------------------------------------------------------------- issue 35: one mutant of each kind
# (tests/course/test_mutants.py: a hygiene mutant is caught by a hygiene probe, a constants or space mutant by the
# drawn cases with the hand-picked edges off)
class LiveBytesCountedOnTheClass(_LiveBase):
    """A right counter that also counts its instances on the class ("how many counters are alive")."""

    instances = 0

    def __init__(self):
        super().__init__()
        LiveBytesCountedOnTheClass.instances += 1

    def track(self, t):
        st = t.untyped_storage()
        if st._cdata not in self._refs or self._refs[st._cdata]() is not st:
            self._add(st._cdata, st, st.nbytes())


class LiveBytesFourBytesAnElement(_LiveBase):
    """Storage elements times 4 (every graded tensor of the first cases is float32)."""

    def track(self, t):
        st = t.untyped_storage()
        if st._cdata not in self._refs or self._refs[st._cdata]() is not st:
            self._add(st._cdata, st, st.nbytes() // t.element_size() * 4)


_OWNERS: dict = {}


def categorize_owners_cached(t, model=None, optimizer=None, phase=None):
    """Right rule, but the owners' storages are cached per model in a module-level dict (built once: stale after the
    step replaces a .grad, and the cache keeps every model's storages)."""
    from memlab.course.reference.ch01 import categorize

    _OWNERS.setdefault(id(model), [p for p in _params(model, optimizer)])
    return categorize(t, model, optimizer, phase)


def categorize_adam_keys_only(t, model=None, optimizer=None, phase=None):
    """Optimizer state recognised by AdamW's keys only (the graded optimizer's): momentum_buffer, square_avg, sum,
    max_exp_avg_sq go by their phase."""
    return _owner(t, model, optimizer, state=lambda k: k in ("exp_avg", "exp_avg_sq", "step")) or _BORN[phase]


def peaks_last_run_of_each_phase(timeline):
    """Assumes the phases come in one run each (forward, backward, optimizer): a phase seen again restarts its peak."""
    out, last = {}, None
    for _, phase, by_cat in timeline:
        tot = sum(by_cat.values())
        out[phase] = tot if phase != last else max(out[phase], tot)
        last = phase
    return out


_FAKE_MEMO: dict = {}


def fake_memoised(config, batch_size, seq_len):
    """Right count, memoised in a module-level dict keyed by (config, batch, seq)."""
    key = (repr(config), batch_size, seq_len)
    if key not in _FAKE_MEMO:
        _FAKE_MEMO[key] = _fake(config, batch_size, seq_len)
    return _FAKE_MEMO[key]


def fake_block_size_tokens(config, batch_size, seq_len):
    """Builds the batch of config.block_size tokens (the context), not seq_len."""
    return _fake(config, batch_size, config.block_size)


def fake_in_eval_mode(config, batch_size, seq_len):
    """The fake model in eval mode: no dropout masks are saved (the graded small models have dropout 0)."""
    from memlab.course.reference.ch01 import fake_activation_bytes

    class Eval(TinyGPT):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.eval()

    import memlab.models as models

    saved, models.TinyGPT = models.TinyGPT, Eval
    try:
        return fake_activation_bytes(config, batch_size, seq_len)
    finally:
        models.TinyGPT = saved


def train_slices_batches(model, opt, batches, steps):
    """`for x, y in batches[:steps]`: a list works, a generator or itertools.repeat does not."""
    history = []
    for x, y in list(batches[:steps]):
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(loss.item())
    return history


MUTANTS["01.live_bytes"] += [("instances counted on the class", LiveBytesCountedOnTheClass),
                             ("4 bytes an element", LiveBytesFourBytesAnElement)]
MUTANTS["01.categorize"] += [("owners cached per model in a module-level dict", categorize_owners_cached),
                             ("AdamW's state keys only", categorize_adam_keys_only)]
MUTANTS["01.phase_peaks"] += [("one run per phase assumed", peaks_last_run_of_each_phase)]
MUTANTS["01.fake_activations"] += [("memoised in a module-level dict", fake_memoised),
                                   ("block_size tokens, not seq_len", fake_block_size_tokens),
                                   ("the fake model in eval mode", fake_in_eval_mode)]
MUTANTS["01.fix_the_leak"] += [("batches sliced with [:steps]", train_slices_batches)]

KINDS = {
    "01.live_bytes": {"hygiene": ["instances counted on the class"], "constants": ["4 bytes an element"],
                      "space": ["bytes of the view, not of the storage", "a dead storage's address never forgotten"]},
    "01.categorize": {"hygiene": ["owners cached per model in a module-level dict"],
                      "constants": ["AdamW's state keys only"],
                      "space": ["buffers not counted as parameters", "tensors compared by data_ptr()"]},
    "01.phase_peaks": {"hygiene": ["sorts the caller's timeline in place"],
                       "constants": ["every phase reported, 0 when absent"], "space": ["one run per phase assumed"]},
    "01.fake_activations": {"hygiene": ["memoised in a module-level dict"], "constants": ["block_size tokens, not seq_len"],
                            "space": ["the fake model in eval mode"]},
    "01.fix_the_leak": {"hygiene": ["a hidden list of losses with retained graphs"],
                        "space": ["batches sliced with [:steps]"]},
}
NOT_APPLICABLE = {"01.fix_the_leak": {"constants": "the loop takes no size or setting of its own: the model, the "
                                                  "optimizer, the batches and the step count are the caller's"}}


# right answers written another way (the over-specific kind): each must PASS
def train_zero_grad_first(model, opt, batches, steps):
    """zero_grad at the start of each step (the gradients of the last step stay until the next one)."""
    history, it = [], iter(batches)
    for _ in range(steps):
        x, y = next(it)
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        history.append(loss.item())
    return history


class LiveBytesWithFinalize:
    """weakref.finalize on each storage instead of a weakref callback, storages keyed by their _cdata."""

    def __init__(self):
        self.current = self.peak = 0
        self._alive = {}

    def track(self, t):
        st = t.untyped_storage()
        f = self._alive.get(st._cdata)
        if f is not None and f.alive:
            return
        n = st.nbytes()
        self._alive[st._cdata] = weakref.finalize(st, self._free, n)
        self.current += n
        self.peak = max(self.peak, self.current)

    def _free(self, n):
        self.current -= n


def peaks_with_defaultdict(timeline):
    """A defaultdict of running maxima, over the events in any order."""
    import collections

    out = collections.defaultdict(int)
    for event in timeline:
        out[event.phase] = max(out[event.phase], sum(event.bytes.values()))
    return out


RIGHT_ANSWERS = {
    "01.fix_the_leak": [("zero_grad at the start of each step", train_zero_grad_first)],
    "01.live_bytes": [("weakref.finalize on each storage", LiveBytesWithFinalize)],
    "01.phase_peaks": [("a defaultdict of running maxima", peaks_with_defaultdict)],
}
