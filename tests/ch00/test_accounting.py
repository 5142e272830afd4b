"""memlab.accounting's arguments and re-exports (its formulas are graded in tests/ch00/test_checks_ch00.py)."""
from __future__ import annotations

import pytest
import torch

from memlab import accounting
from memlab.core import units


def test_format_bytes_is_the_one_in_memlab_core_units():
    assert accounting.format_bytes is units.format_bytes
    assert accounting.format_bytes(1536) == "1.50 KiB" and accounting.format_bytes(3 * units.GiB, "MiB") == "3,072.00 MiB"


@pytest.mark.parametrize("call,message", [
    (lambda: accounting.activation_bytes_per_layer(0, 1, 8, 2), "seq_len=0 is invalid; allowed: an int >= 1"),
    (lambda: accounting.activation_bytes_per_layer(4, True, 8, 2), "batch_size=True is invalid; allowed: an int >= 1"),
    (lambda: accounting.activation_bytes_per_layer(4, 1, 8, 2, act_bytes=3), "act_bytes=3 is invalid; allowed: 1, 2, 4, 8"),
    (lambda: accounting.activation_bytes_per_layer(4, 1, 8, 2, mask_bytes=True), "mask_bytes=True is invalid"),
    (lambda: accounting.activation_bytes_per_layer(4, 1, 8, 2, recompute="some"),
     "recompute='some' is invalid; allowed: 'none', 'selective', 'full'"),
    (lambda: accounting.korthikanti_bytes_per_layer(4, 1, -8, 2), "hidden=-8 is invalid; allowed: an int >= 1"),
    (lambda: accounting.model_state_bytes(-1), "n_params=-1 is invalid; allowed: an int >= 0"),
    (lambda: accounting.model_state_bytes(10, "bf16"), "recipe='bf16' is invalid; allowed: 'fp32-adamw'"),
    (lambda: accounting.dtype_bytes("fp12"), "dtype='fp12' is invalid; allowed: a torch.dtype or one of"),
    (lambda: accounting.optimizer_state_bytes(None), "optimizer=None is invalid; allowed: a torch.optim.Optimizer"),
])
def test_bad_arguments_in_the_one_error_format(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value).startswith(message), str(err.value)


def test_recipes_precision_part_names_a_vocab_recipe():
    """Each RECIPES key starts with fp32 or mixed, the two precisions its docstring maps onto memlab.core.vocab."""
    assert {k.split("-", 1)[0] for k in accounting.RECIPES} == {"fp32", "mixed"}
    assert accounting.RECIPES["mixed-adamw"].total == accounting.RECIPES["fp32-adamw"].total == 16


def test_dtype_bytes():
    assert accounting.dtype_bytes("bf16") == 2 and accounting.dtype_bytes(torch.float64) == 8
