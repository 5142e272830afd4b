"""Chapter 00's checks fail on plausible wrong answers (memlab's own answers pass: tests/course/test_course.py)."""
from __future__ import annotations

import torch

from memlab import accounting
from memlab.course.grading import check


def status(exercise: str, obj) -> str:
    return check(exercise, obj, quiet=True).status


def test_model_state_bytes_wrong_answers_fail():
    def adam_one_state(n, recipe):  # forgets that Adam keeps two moments
        out = dict(accounting.model_state_bytes(n, recipe))
        if recipe == "fp32-adamw":
            out["optimizer"] //= 2
            out["total"] = out["weights"] + out["gradients"] + out["optimizer"]
        return out

    def mixed_halves_everything(n, recipe):  # "half precision halves memory"
        if recipe == "mixed-adamw":
            return {k: v // 2 for k, v in accounting.model_state_bytes(n, "fp32-adamw").items()}
        return accounting.model_state_bytes(n, recipe)

    assert status("00.model_state_bytes", adam_one_state) == "fail"
    assert status("00.model_state_bytes", mixed_halves_everything) == "fail"
    assert status("00.model_state_bytes", lambda n, r: 16 * n) == "fail"  # not a dict


def test_optimizer_state_bytes_wrong_answers_fail():
    def moments_only(opt):  # forgets AdamW's `step` tensors
        return sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")

    def from_params(opt):  # predicts 8 B/param instead of counting
        return sum(8 * p.numel() for g in opt.param_groups for p in g["params"])

    assert status("00.optimizer_state_bytes", moments_only) == "fail"
    assert status("00.optimizer_state_bytes", from_params) == "fail"


def test_activation_bytes_wrong_answers_fail():
    def paper_only(s, b, h, a, act_bytes=2, mask_bytes=1):  # ignores e and m
        return s * b * h * (34 + 5 * a * s // h)

    def no_masks(s, b, h, a, act_bytes=2, mask_bytes=1):
        return s * b * h * 16 * act_bytes + a * s * s * b * 2 * act_bytes

    assert status("00.activation_bytes", paper_only) == "fail"
    assert status("00.activation_bytes", no_masks) == "fail"


def test_saved_bytes_wrong_answers_fail():
    def per_tensor(fn, *args):  # counts views twice
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args)
        return total

    def with_weights(fn, *args):  # counts the layer's own weights as activations
        return accounting.saved_activation_bytes(lambda *a: fn(*a), *args)

    assert status("00.saved_bytes", per_tensor) == "fail"
    assert status("00.saved_bytes", with_weights) == "fail"


class _AlwaysEqual(int):
    """An int whose == says yes to everything (issue 9): it must not pass any check."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


def test_an_always_equal_int_fails_every_exercise():
    keys = ("weights", "gradients", "optimizer", "total")
    assert status("00.model_state_bytes", lambda n, r: {k: _AlwaysEqual(0) for k in keys}) == "fail"
    assert status("00.optimizer_state_bytes", lambda opt: _AlwaysEqual(0)) == "fail"
    assert status("00.activation_bytes", lambda *a, **k: _AlwaysEqual(0)) == "fail"
    assert status("00.saved_bytes", lambda *a: _AlwaysEqual(0)) == "fail"
    r = check("00.activation_bytes", lambda *a, **k: _AlwaysEqual(0), quiet=True)
    assert "expected an int" in r.message and "_AlwaysEqual" in r.message


def test_dropout_0_formula_matches_a_measured_block():
    """With dropout 0 the softmax output is saved once: a*s^2*b*e, not 2e (issue 24)."""
    from memlab.models import TinyGPT, TinyGPTConfig

    s, b, h, a = 32, 2, 64, 4
    torch.manual_seed(0)
    block = TinyGPT(TinyGPTConfig(n_layer=1, n_embd=h, n_head=a, block_size=s, dropout=0.0)).blocks[0]
    measured = accounting.saved_activation_bytes(block, torch.randn(b, s, h, requires_grad=True))
    assert measured == accounting.activation_bytes_per_layer(s, b, h, a, act_bytes=4, mask_bytes=0,
                                                             layernorm_stats_bytes=4)
    # the old formula, 2e per score with m = 0, is one score matrix too many
    old = s * b * h * 16 * 4 + a * s * s * b * 2 * 4 + 16 * s * b
    assert old - measured == a * s * s * b * 4


def test_saved_storages_are_told_apart_by_identity():
    """Three storages saved in turn at one address count three times; a view at an offset counts its
    whole storage once, whichever is seen first."""
    w = torch.randn(32, 32, requires_grad=True)
    mem = bytearray(32 * 32 * 4)

    def reused(t):
        for _ in range(3):
            (t * torch.frombuffer(mem, dtype=torch.float32).view(32, 32)).sum()
        return t.sum()

    assert accounting.saved_activation_bytes(reused, w) == 3 * 4096
    assert accounting.saved_activation_bytes(lambda t: (t[8:].exp() * t[8:]).sum() + (t * t).sum(), w) == 4096 + 24 * 32 * 4
    assert accounting.saved_activation_bytes(lambda t: (t[28:] * t[28:]).sum(), w) == 4096


def test_saved_bytes_keyed_by_address_with_the_tensors_held_passes():
    """A right answer written another way (issue 35): storages keyed by their address, each saved tensor held
    until the count is done, so no freed block can lend its address to another storage."""
    from torch import nn

    def saved_bytes(fn, *args):
        params = {p.untyped_storage().data_ptr() for p in (list(fn.parameters()) + list(fn.buffers())
                                                           if isinstance(fn, nn.Module) else [])}
        held, sizes = [], {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                held.append(t)
                sizes[(t.device, st.data_ptr())] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args)
        return sum(sizes.values())

    r = check("00.saved_bytes", saved_bytes, quiet=True)
    assert r.status == "pass" and r.points == 1.0, r.message
