"""memlab.core: byte units, the one argument-check format, the shared vocabulary; no torch needed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from memlab.core import units, validation, vocab
from memlab.core.units import GB, GiB, KiB, MiB, TiB, format_bytes, parse_size
from memlab.core.validation import check_bool, check_choice, check_int, check_number, check_positive_int, invalid
from memlab.core.vocab import CATEGORIES, PHASES, Category, Optimizer, Phase, Recipe


def test_units_are_powers_of_two_and_ten():
    assert (KiB, MiB, GiB, TiB) == (1024, 1024**2, 1024**3, 1024**4)
    assert GB == 10**9


@pytest.mark.parametrize("n,unit,want", [
    (0, "auto", "0 B"), (1023, "auto", "1023 B"), (1536, "auto", "1.50 KiB"), (-3 * MiB, "auto", "-3.00 MiB"),
    (5 * GiB // 2, "auto", "2.50 GiB"), (2 * TiB, "auto", "2.00 TiB"), (3 * GiB, "MiB", "3,072.00 MiB"),
    (24 * GB, "GB", "24.00 GB"),
])
def test_format_bytes(n, unit, want):
    assert format_bytes(n, unit) == want


def test_format_bytes_refuses_an_unknown_unit():
    with pytest.raises(ValueError, match=r"unit='MB' is invalid; allowed: 'auto', 'KiB'"):
        format_bytes(1, "MB")


@pytest.mark.parametrize("text,want", [
    ("24GB", 24 * 10**9), ("80GiB", 80 * GiB), ("24e9", 24 * 10**9), (512, 512), ("1.5 MiB", 3 * MiB // 2),
    (" 2 kib ", 2048), ("3t", 3 * 10**12), (2.0, 2),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "GB", "12 parsecs", "-1GB", "0", 0, float("nan"), float("inf"), True, "1e999",
                                 "1e300 GiB", 10**400, -(10**400)])  # beyond a float: not an OverflowError
def test_parse_size_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"^budget=.* is invalid; allowed: "):
        parse_size(bad, name="budget")


def test_invalid_is_the_one_format_and_shortens_long_values():
    e = invalid("x", "y" * 200, "something else")
    assert isinstance(e, ValueError)
    text = str(e)
    assert text.startswith("x='yyy") and text.endswith("...' is invalid; allowed: something else"[-33:])
    assert len(text) < 140


@pytest.mark.parametrize("value,kw,ok", [
    (3, {}, True), (-3, {}, True), (3, {"minimum": 3}, True), (2, {"minimum": 3}, False),
    (4, {"maximum": 3}, False), (True, {}, False), (3.0, {}, False), ("3", {}, False), (None, {}, False),
])
def test_check_int(value, kw, ok):
    if ok:
        assert check_int("n", value, **kw) == value
    else:
        with pytest.raises(ValueError, match=r"^n=.* is invalid; allowed: an int"):
            check_int("n", value, **kw)


def test_check_positive_int_states_the_range():
    assert check_positive_int("batch", 1) == 1
    with pytest.raises(ValueError, match=r"batch=0 is invalid; allowed: an int >= 1$"):
        check_positive_int("batch", 0)
    with pytest.raises(ValueError, match=r"batch=9 is invalid; allowed: an int from 1 to 8$"):
        check_positive_int("batch", 9, maximum=8)


@pytest.mark.parametrize("value,kw,ok", [
    (0.5, {"minimum": 0, "maximum": 1}, True), (0, {"minimum": 0, "strict_minimum": True}, False),
    (1e-9, {"minimum": 0, "strict_minimum": True}, True), (float("nan"), {}, False), (float("inf"), {}, False),
    (False, {}, False), ("1", {}, False), (2, {"maximum": 1}, False),
])
def test_check_number(value, kw, ok):
    if ok:
        assert check_number("lr", value, **kw) == float(value)
    else:
        with pytest.raises(ValueError, match=r"^lr=.* is invalid; allowed: a finite number"):
            check_number("lr", value, **kw)


def test_check_choice_and_bool():
    assert check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"mode='c' is invalid; allowed: 'a', 'b'"):
        check_choice("mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match=r"mode=\[\] is invalid"):  # unhashable: not one of them
        check_choice("mode", [], {"a", "b"})
    assert check_bool("flag", False) is False
    with pytest.raises(ValueError, match=r"flag=1 is invalid; allowed: True or False"):
        check_bool("flag", 1)


@pytest.mark.parametrize("spelling,want", [
    ("fp32", Recipe.FP32), ("bf16", Recipe.BF16_MIXED), ("BF16-Mixed", Recipe.BF16_MIXED),
    ("fp16", Recipe.FP16_MIXED), ("bf16-pure", Recipe.BF16_PURE), ("bf16-true", Recipe.BF16_PURE),
    (Recipe.FP16_MIXED, Recipe.FP16_MIXED),
])
def test_recipe_spellings(spelling, want):
    assert vocab.recipe(spelling) is want


@pytest.mark.parametrize("spelling,want", [
    ("adamw", Optimizer.ADAMW), ("adam8bit", Optimizer.ADAMW8BIT), ("AdamW_8bit", Optimizer.ADAMW8BIT),
    ("offload-adamw", Optimizer.OFFLOAD_ADAMW), ("sgd", Optimizer.SGD),
])
def test_optimizer_spellings(spelling, want):
    assert vocab.optimizer(spelling) is want


@pytest.mark.parametrize("parse,bad", [(vocab.recipe, "fp8"), (vocab.recipe, None), (vocab.optimizer, "lion")])
def test_vocab_errors_list_values_and_aliases(parse, bad):
    with pytest.raises(ValueError, match=r"is invalid; allowed: .*\(aliases: "):
        parse(bad, argument="what")


def test_enums_compare_equal_to_their_old_strings():
    assert Category.ACTIVATIONS == "activations" and str(Phase.BACKWARD) == "backward"
    assert CATEGORIES == ("parameters", "gradients", "optimizer", "activations", "other")
    assert PHASES == ("forward", "backward", "optimizer", "other")
    assert f"{Recipe.BF16_MIXED}" == "bf16-mixed"


def test_core_imports_without_torch():
    code = ("import sys, memlab.core, memlab.core.env, memlab.core.gpus; "
            "assert 'torch' not in sys.modules, 'memlab.core imported torch'; "
            "assert memlab.core.gpus is memlab.core.gpus")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_units_module_has_no_local_copies_elsewhere():
    """memlab.accounting's size helpers are memlab.core's (one implementation)."""
    from memlab import accounting

    assert accounting.format_bytes is units.format_bytes
    assert validation.check_positive_int is check_positive_int


def test_write_cache_file_is_atomic_and_silent_on_failure(tmp_path):
    """memlab's caches write one way: whole or not at all, no temporary file left, no exception."""
    import pickle

    from memlab.core.cachefile import write_cache_file

    path = tmp_path / "a" / "b" / "entry.pkl"
    assert write_cache_file(path, {"x": 1}) is True
    assert pickle.loads(path.read_bytes()) == {"x": 1}
    assert write_cache_file(path, lambda: None) is False  # a lambda does not pickle: the old entry stays whole
    assert pickle.loads(path.read_bytes()) == {"x": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["entry.pkl"]
