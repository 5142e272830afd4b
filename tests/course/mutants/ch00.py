"""Plausible wrong answers to chapter 00's exercises; tests/course/test_mutants.py asserts each FAILS.

MUTANTS maps an exercise id to (name, wrong implementation) pairs.
"""
from __future__ import annotations

import torch
from torch import nn


# ----------------------------------------------------------------------------- 00.model_state_bytes
def _states(table):
    def fn(n_params, recipe):
        w, g, o = table[recipe]
        out = {"weights": w * n_params, "gradients": g * n_params, "optimizer": o * n_params}
        out["total"] = sum(out.values())
        return out
    return fn


RIGHT = {"fp32-adamw": (4, 4, 8), "fp32-sgd": (4, 4, 0), "mixed-adamw": (2, 2, 12)}
mixed_without_master = _states({**RIGHT, "mixed-adamw": (2, 2, 8)})     # forgets the fp32 master copy
mixed_fp32_grads = _states({**RIGHT, "mixed-adamw": (2, 4, 12)})        # AMP's grads, not the recipe's
sgd_with_momentum = _states({**RIGHT, "fp32-sgd": (4, 4, 4)})           # counts a momentum buffer
adam_one_moment = _states({**RIGHT, "fp32-adamw": (4, 4, 4)})          # one moment instead of two


def total_without_grads(n_params, recipe):
    out = _states(RIGHT)(n_params, recipe)
    out["total"] = out["weights"] + out["optimizer"]
    return out


# ----------------------------------------------------------------------------- 00.optimizer_state_bytes
def numel_times_4(optimizer):
    """Assumes every state tensor is fp32 (wrong for the int/float `step` counters and other dtypes)."""
    return sum(v.numel() * 4 for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def no_dedup(optimizer):
    """Counts each tensor, even when several are views of one storage."""
    return sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def element_bytes_of_views(optimizer):
    """numel * element_size of each tensor: a view counts its own elements, not its storage's."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def moments_only(optimizer):
    """Counts exp_avg / exp_avg_sq / momentum_buffer, forgets step and max_exp_avg_sq."""
    keys = {"exp_avg", "exp_avg_sq", "momentum_buffer"}
    return sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for k, v in s.items()
               if k in keys and isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------------- 00.activation_bytes
def no_mask_term(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    s, b, h, a, e, m = seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes
    return s * b * h * 16 * e + a * s * s * b * 2 * e


def hard_coded_paper(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    """The paper's 34 s b h + 5 a s^2 b, ignoring act_bytes and mask_bytes."""
    s, b, h, a = seq_len, batch_size, hidden, n_heads
    return 34 * s * b * h + 5 * a * s * s * b


def attention_linear_in_s(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    s, b, h, a, e, m = seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes
    return s * b * h * (16 * e + 2 * m) + a * s * b * (2 * e + m)


def one_mask_only(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    s, b, h, a, e, m = seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes
    return s * b * h * (16 * e + m) + a * s * s * b * (2 * e + m)


# ----------------------------------------------------------------------------- 00.saved_bytes
def _saved(fn, args, *, dedup=True, skip_params=True, use_numel=False):
    key = lambda t: (t.device, t.untyped_storage().data_ptr())  # noqa: E731
    skip = {key(t) for t in list(fn.parameters()) + list(fn.buffers())} if skip_params and isinstance(fn, nn.Module) else set()
    seen: dict = {}
    total = [0]

    def pack(t):
        if key(t) in skip:
            return t
        nbytes = t.numel() * t.element_size() if use_numel else t.untyped_storage().nbytes()
        if dedup:
            seen[key(t)] = nbytes
        else:
            total[0] += nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values()) + total[0]


def saved_no_dedup(fn, *args):
    return _saved(fn, args, dedup=False)


def saved_counts_weights(fn, *args):
    return _saved(fn, args, skip_params=False)


def saved_numel_of_views(fn, *args):
    return _saved(fn, args, use_numel=True)


def output_bytes(fn, *args):
    """Measures what fn returns instead of what it saves for backward."""
    out = fn(*args)
    return out.numel() * out.element_size()


MUTANTS = {
    "00.model_state_bytes": [
        ("mixed precision without the fp32 master copy", mixed_without_master),
        ("mixed precision with fp32 gradients", mixed_fp32_grads),
        ("plain SGD with a momentum buffer", sgd_with_momentum),
        ("AdamW with one moment", adam_one_moment),
        ("total forgets the gradients", total_without_grads),
    ],
    "00.optimizer_state_bytes": [
        ("every state tensor assumed fp32", numel_times_4),
        ("no storage dedup", no_dedup),
        ("elements of views, not storages", element_bytes_of_views),
        ("moments only (no step, no max_exp_avg_sq)", moments_only),
    ],
    "00.activation_bytes": [
        ("no dropout-mask term", no_mask_term),
        ("the paper's constants, ignoring act_bytes and mask_bytes", hard_coded_paper),
        ("attention term linear in s", attention_linear_in_s),
        ("one dropout mask per layer instead of two", one_mask_only),
    ],
    "00.saved_bytes": [
        ("no storage dedup", saved_no_dedup),
        ("the module's weights counted as activations", saved_counts_weights),
        ("elements of views, not storages", saved_numel_of_views),
        ("bytes of the output, not of what is saved", output_bytes),
    ],
}


# ----------------------------------------------------------------------------- 00.predict_peak
def _peak_parts(config, b, s, *, e=4, m=4):
    from memlab.accounting import activation_bytes_per_layer
    from memlab.models import TinyGPT

    with torch.device("meta"):
        model = TinyGPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    h, a, V = config.n_embd, config.n_head, config.vocab_size
    acts = config.n_layer * activation_bytes_per_layer(s, b, h, a, act_bytes=e, mask_bytes=m, layernorm_stats_bytes=4)
    acts += b * s * h * m + 3 * b * s * h * e + b * s * V * e
    return n_params, acts


def peak_states_only(config, batch_size, seq_len):
    """16 bytes per parameter, no activations."""
    n, _ = _peak_parts(config, batch_size, seq_len)
    return 16 * n


def peak_backward_only(config, batch_size, seq_len):
    """Weights + Adam state + activations: forgets that the optimizer step can hold the peak."""
    n, acts = _peak_parts(config, batch_size, seq_len)
    return 12 * n + acts


def peak_everything_at_once(config, batch_size, seq_len):
    """Gradients counted in full while the activations are alive (they never coexist in full)."""
    n, acts = _peak_parts(config, batch_size, seq_len)
    return 16 * n + acts


def peak_16bit_activations(config, batch_size, seq_len):
    """The paper's 16-bit activations and 1-byte masks for an fp32 step on a CPU."""
    n, acts = _peak_parts(config, batch_size, seq_len, e=2, m=1)
    return max(16 * n, 12 * n + acts)


MUTANTS["00.predict_peak"] = [
    ("states only", peak_states_only),
    ("backward phase only", peak_backward_only),
    ("gradients and activations at once", peak_everything_at_once),
    ("16-bit activations", peak_16bit_activations),
]


# ----------------------------------------------------------------------------- issue 24: new wrong answers
class _Bytes(int):
    """An int subclass (a unit-carrying type): not an int."""


def states_as_floats(n_params, recipe):
    return {k: float(v) for k, v in _states(RIGHT)(n_params, recipe).items()}


def states_numpy(n_params, recipe):
    import numpy as np

    return {k: np.int64(v) for k, v in _states(RIGHT)(n_params, recipe).items()}


def states_int_subclass(n_params, recipe):
    return {k: _Bytes(v) for k, v in _states(RIGHT)(n_params, recipe).items()}


def opt_keyed_by_tensor_data_ptr(optimizer):
    """Keys each state tensor by its own data_ptr(): a view at an offset counts its storage again."""
    seen = {}
    for s in optimizer.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                seen[(v.device, v.data_ptr())] = v.untyped_storage().nbytes()
    return sum(seen.values())


def opt_view_offset_to_end(optimizer):
    """Keys by storage, but a view counts from its offset to the end of the storage (first seen wins)."""
    seen = {}
    for s in optimizer.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                key = (v.device, v.untyped_storage().data_ptr())
                seen.setdefault(key, v.untyped_storage().nbytes() - v.storage_offset() * v.element_size())
    return sum(seen.values())


def opt_first_group_only(optimizer):
    """Counts the state of the first parameter group's parameters only."""
    seen = {}
    for p in optimizer.param_groups[0]["params"]:
        for v in optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                seen[(v.device, v.untyped_storage().data_ptr())] = v.untyped_storage().nbytes()
    return sum(seen.values())


def act_integer_division(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    """The s^2 term as s*b*h * (a*s // h) * (2e + m): exact only when h divides a*s."""
    s, b, h, a, e, m = seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes
    return s * b * h * (16 * e + 2 * m) + s * b * h * (a * s // h) * (2 * e + m)


def act_no_dropout_twice(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    """m = 0 read as 'no masks' only: the softmax output and the dropped-out copy still counted twice."""
    s, b, h, a, e, m = seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes
    return s * b * h * (16 * e + 2 * m) + a * s * s * b * (2 * e + m)


def act_float(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    """The paper's form with a true division: a float (and rounding) where bytes are an int."""
    s, b, h, a, e, m = seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes
    t = (2 * e + m) if m else e
    return s * b * h * (16 * e + 2 * m + a * s / h * t)


def _saved_keyed(fn, args, key, nbytes=lambda t: t.untyped_storage().nbytes(), first=False):
    skip = {key(t) for t in list(fn.parameters()) + list(fn.buffers())} if isinstance(fn, nn.Module) else set()
    seen: dict = {}

    def pack(t):
        k = key(t)
        if k not in skip and not (first and k in seen):
            seen[k] = nbytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def saved_keyed_by_tensor_data_ptr(fn, *args):
    """Keys by the tensor's data_ptr() (offset included): a view at an offset is another storage."""
    return _saved_keyed(fn, args, key=lambda t: (t.device, t.data_ptr()))


def saved_keyed_by_address(fn, *args):
    """Keys by the storage's address without holding it: a freed storage's address, reused, counts once."""
    return _saved_keyed(fn, args, key=lambda t: (t.device, t.untyped_storage().data_ptr()))


def saved_view_offset_to_end(fn, *args):
    """Keys by storage, but the first view seen counts from its offset to the storage's end."""
    return _saved_keyed(fn, args, key=lambda t: (t.device, t.untyped_storage().data_ptr()), first=True,
                        nbytes=lambda t: t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())


def _peak_ref_like(config, b, s, *, m=4, temps=True, foreach=False):
    """memlab's model (accounting.tinygpt_step_peak) with one knob turned."""
    from memlab.accounting import activation_bytes_per_layer
    from memlab.models import TinyGPT

    with torch.device("meta"):
        model = TinyGPT(config)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    buffers = sum(t.numel() * t.element_size() for t in model.buffers())
    largest = max(p.numel() for p in params) * 4
    h, a, V = config.n_embd, config.n_head, config.vocab_size
    acts = config.n_layer * activation_bytes_per_layer(s, b, h, a, act_bytes=4, mask_bytes=m, layernorm_stats_bytes=4)
    acts += b * s * 8 + s * 8 + b * s * h * m + b * s * h * 4 + 2 * b * s * 4 + b * s * h * 4 + b * s * V * 4 + b * s * 8 + 4
    states = 12 * n + buffers + 4 * len(params)
    backward = states + acts + b * s * V * 4 + a * s * s * b * 4
    optimizer = states + 4 * n + (2 * 4 * n if foreach else 2 * largest if temps else 0)
    return int(max(backward, optimizer))


def peak_cuda_masks(config, batch_size, seq_len):
    """CUDA's 1-byte bool dropout masks, for a CPU run (whose dropout keeps 4-byte noise)."""
    return _peak_ref_like(config, batch_size, seq_len, m=1)


def peak_no_optimizer_temporaries(config, batch_size, seq_len):
    """Weights, grads and moments in the step, nothing for the for-loop AdamW's temporaries."""
    return _peak_ref_like(config, batch_size, seq_len, temps=False)


def peak_foreach_temporaries(config, batch_size, seq_len):
    """The foreach AdamW's temporaries (a copy of every parameter, twice) for the CPU's for-loop."""
    return _peak_ref_like(config, batch_size, seq_len, foreach=True)


def peak_numpy(config, batch_size, seq_len):
    """Right value, as a numpy float: not a Python number."""
    import numpy as np

    from memlab.accounting import tinygpt_step_peak

    return np.float64(tinygpt_step_peak(config, batch_size, seq_len))


MUTANTS["00.model_state_bytes"] += [
    ("float byte counts", states_as_floats),
    ("numpy int64 byte counts", states_numpy),
    ("an int subclass", states_int_subclass),
]
MUTANTS["00.optimizer_state_bytes"] += [
    ("keyed by the tensor's data_ptr()", opt_keyed_by_tensor_data_ptr),
    ("a view counted from its offset to the end", opt_view_offset_to_end),
    ("first parameter group only", opt_first_group_only),
]
MUTANTS["00.activation_bytes"] += [
    ("integer division a*s // h", act_integer_division),
    ("dropout 0 still saves the probabilities twice", act_no_dropout_twice),
    ("a float from a true division", act_float),
]
MUTANTS["00.saved_bytes"] += [
    ("keyed by the tensor's data_ptr()", saved_keyed_by_tensor_data_ptr),
    ("keyed by a freed storage's reusable address", saved_keyed_by_address),
    ("a view counted from its offset to the end", saved_view_offset_to_end),
]
MUTANTS["00.predict_peak"] += [
    ("1-byte (CUDA) dropout masks on the CPU", peak_cuda_masks),
    ("no optimizer temporaries", peak_no_optimizer_temporaries),
    ("foreach AdamW temporaries", peak_foreach_temporaries),
    ("a numpy float", peak_numpy),
]


# ----------------------------------------------------------------------------- issue 35: the kinds that passed unseen
def states_in_floats(n_params, recipe):
    """Bytes per parameter as floats, then int(): exact below 2**53 / 16 parameters, off above it."""
    per = {"fp32-adamw": (4.0, 4.0, 8.0), "fp32-sgd": (4.0, 4.0, 0.0), "mixed-adamw": (2.0, 2.0, 12.0)}[recipe]
    out = {k: int(v * n_params) for k, v in zip(("weights", "gradients", "optimizer"), per)}
    out["total"] = int(sum(per) * n_params)
    return out


def states_default_recipe(n_params, recipe):
    """An unknown recipe falls back to fp32-adamw (a guess instead of an error)."""
    table = {"fp32-adamw": (4, 4, 8), "fp32-sgd": (4, 4, 0), "mixed-adamw": (2, 2, 12)}
    return _states(table)(n_params, recipe if recipe in table else "fp32-adamw")


_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step")


def state_bytes_known_keys(optimizer):
    """Counts only the keys of Adam and SGD (every graded optimizer's): RMSprop's square_avg, Adagrad's sum missed."""
    seen = {}
    for st in optimizer.state.values():
        for k, v in st.items():
            if k in _ADAM_KEYS and isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def state_bytes_ignores_frozen_groups(optimizer):
    """Counts the state of the first parameter group only (one group in most graded optimizers)."""
    seen = {}
    for p in optimizer.param_groups[0]["params"]:
        for v in optimizer.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def activation_bytes_table(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    """Element sizes from a table of the graded ones (2 and 4 bytes): 1-byte (fp8) and 8-byte (fp64) activations fail."""
    e = {2: 2, 4: 4}[act_bytes]
    m = {0: 0, 1: 1, 2: 2, 4: 4}[mask_bytes]
    s, b, h, a = seq_len, batch_size, hidden, n_heads
    return s * b * h * (16 * e + 2 * m) + a * s * s * b * ((2 * e + m) if m else e)


def activation_bytes_one_byte_masks(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1):
    """Any dropout costs 1-byte masks (the paper's): mask_bytes=2 or 4 counted as 1."""
    s, b, h, a, e = seq_len, batch_size, hidden, n_heads, act_bytes
    m = 1 if mask_bytes else 0
    return s * b * h * (16 * e + 2 * m) + a * s * s * b * ((2 * e + m) if m else e)


def saved_bytes_fp32_elements(fn, *args):
    """4 bytes per element of each saved storage (every graded tensor is float32): bf16, fp16, fp64 miscounted."""
    seen = {}
    skip = {id(p) for p in (list(fn.parameters()) + list(fn.buffers()) if isinstance(fn, nn.Module) else [])}

    def pack(t):
        if id(t) not in skip:
            st = t.untyped_storage()
            seen[st.data_ptr()] = (st, 4 * st.nbytes() // t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(n for _, n in seen.values())


def saved_bytes_hooks_left(fn, *args):
    """Finds the saved tensors with forward hooks on every submodule, and never removes them."""
    from memlab.accounting import saved_activation_bytes

    if isinstance(fn, nn.Module):
        for m in fn.modules():
            m.register_forward_hook(lambda mod, inp, out: None)
    return saved_activation_bytes(fn, *args)


MUTANTS["00.model_state_bytes"] += [
    ("bytes computed in floats", states_in_floats),
    ("an unknown recipe taken as fp32-adamw", states_default_recipe),
]
MUTANTS["00.optimizer_state_bytes"] += [
    ("only Adam's and SGD's state keys", state_bytes_known_keys),
    ("first parameter group only", state_bytes_ignores_frozen_groups),
]
MUTANTS["00.activation_bytes"] += [
    ("element sizes from a table of 2 and 4", activation_bytes_table),
    ("1-byte masks for any dropout", activation_bytes_one_byte_masks),
]
MUTANTS["00.saved_bytes"] += [
    ("4 bytes per element", saved_bytes_fp32_elements),
    ("forward hooks left on the module", saved_bytes_hooks_left),
]


# ----------------------------------------------------------------------------- issue 35: one mutant of each kind
# (tests/course/test_mutants.py: a hygiene mutant is caught by a hygiene probe, a constants or space mutant by the
# drawn cases with the hand-picked edges off)
_MEMO: dict = {}


def states_memoised(n_params, recipe):
    """Right numbers, memoised in a module-level dict (the dict grows with every call: global state)."""
    key = (n_params, recipe)
    if key not in _MEMO:
        _MEMO[key] = _states(RIGHT)(n_params, recipe)
    return dict(_MEMO[key])


def state_bytes_touching_every_parameter(optimizer):
    """Reads optimizer.state[p] for every parameter: state is a defaultdict, so parameters without state get an empty
    entry inserted into the caller's optimizer."""
    from memlab.accounting import optimizer_state_bytes

    for g in optimizer.param_groups:
        for p in g["params"]:
            optimizer.state[p]  # noqa: B018 - a lookup that inserts
    return optimizer_state_bytes(optimizer)


_ACT_MEMO: dict = {}


def activation_bytes_memoised(seq_len, batch_size, hidden, n_heads, act_bytes=2, mask_bytes=1, **kw):
    """Right formula, memoised in a module-level dict keyed by the arguments."""
    from memlab.accounting import activation_bytes_per_layer

    key = (seq_len, batch_size, hidden, n_heads, act_bytes, mask_bytes, tuple(sorted(kw.items())))
    if key not in _ACT_MEMO:
        _ACT_MEMO[key] = activation_bytes_per_layer(seq_len, batch_size, hidden, n_heads, act_bytes=act_bytes,
                                                    mask_bytes=mask_bytes, **kw)
    return _ACT_MEMO[key]


_PEAKS: dict = {}


def peak_memoised_by_shape(config, batch_size, seq_len):
    """memlab's model, memoised by (n_layer, n_embd, batch, seq): a module-level cache (and it ignores n_head)."""
    from memlab.accounting import tinygpt_step_peak

    key = (config.n_layer, config.n_embd, batch_size, seq_len)
    if key not in _PEAKS:
        _PEAKS[key] = tinygpt_step_peak(config, batch_size, seq_len)
    return _PEAKS[key]


def peak_block_size_as_sequence(config, batch_size, seq_len):
    """The context length (config.block_size) taken for the sequence length: equal whenever the graded sequence
    fills the context."""
    from memlab.accounting import tinygpt_step_peak

    return tinygpt_step_peak(config, batch_size, config.block_size)


def peak_vocab_256(config, batch_size, seq_len):
    """The logits sized for a byte vocabulary of 256 (every graded TinyGPT's default)."""
    import dataclasses

    from memlab.accounting import tinygpt_step_peak

    return tinygpt_step_peak(dataclasses.replace(config, vocab_size=256), batch_size, seq_len)


MUTANTS["00.model_state_bytes"] += [("memoised in a module-level dict", states_memoised)]
MUTANTS["00.optimizer_state_bytes"] += [("optimizer.state[p] read for every parameter (defaultdict inserts)",
                                         state_bytes_touching_every_parameter)]
MUTANTS["00.activation_bytes"] += [("memoised in a module-level dict", activation_bytes_memoised)]
MUTANTS["00.predict_peak"] += [("memoised by shape in a module-level dict", peak_memoised_by_shape),
                               ("block_size taken as the sequence length", peak_block_size_as_sequence),
                               ("a vocabulary of 256", peak_vocab_256)]

KINDS = {
    "00.model_state_bytes": {"hygiene": ["memoised in a module-level dict"], "constants": ["bytes computed in floats"],
                             "space": ["an unknown recipe taken as fp32-adamw"]},
    "00.optimizer_state_bytes": {"hygiene": ["optimizer.state[p] read for every parameter (defaultdict inserts)"],
                                 "constants": ["every state tensor assumed fp32"],
                                 "space": ["first parameter group only", "a view counted from its offset to the end"]},
    "00.activation_bytes": {"hygiene": ["memoised in a module-level dict"],
                            "constants": ["element sizes from a table of 2 and 4", "1-byte masks for any dropout"],
                            "space": ["integer division a*s // h"]},
    "00.saved_bytes": {"hygiene": ["forward hooks left on the module"], "constants": ["4 bytes per element"],
                       "space": ["keyed by the tensor's data_ptr()", "keyed by a freed storage's reusable address",
                                 "the module's weights counted as activations"]},
    "00.predict_peak": {"hygiene": ["memoised by shape in a module-level dict"],
                        "constants": ["a vocabulary of 256", "1-byte (CUDA) dropout masks on the CPU"],
                        "space": ["block_size taken as the sequence length"]},
}


# right answers written another way (the over-specific kind): each must PASS
def saved_bytes_by_address_holding(fn, *args):
    """Keys saved storages by their address and holds every one until the count is done: no freed block can lend
    its address to another storage meanwhile."""
    skip = set()
    if isinstance(fn, nn.Module):
        skip = {t.untyped_storage().data_ptr() for t in list(fn.parameters()) + list(fn.buffers())}
    held, sizes = [], {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            held.append(st)
            sizes[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(sizes.values())


def state_bytes_by_storage_object(optimizer):
    """Storages told apart by the storage objects' identity while all are held (a list of them), not by address."""
    storages = []
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                s = v.untyped_storage()
                if not any(s._cdata == o._cdata for o in storages):
                    storages.append(s)
    return sum(s.nbytes() for s in storages)


RIGHT_ANSWERS = {
    "00.saved_bytes": [("storages keyed by address, held while counting", saved_bytes_by_address_holding)],
    "00.optimizer_state_bytes": [("storage objects compared while held", state_bytes_by_storage_object)],
}
