"""Every plausible wrong answer in tests/mutants/ch06.py FAILS its chapter 06 check."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from memlab.grading import check

_spec = importlib.util.spec_from_file_location("memlab_mutants_ch06", Path(__file__).parent / "mutants" / "ch06.py")
mutants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutants)

CASES = [(ex, name, fn) for ex, items in mutants.MUTANTS.items() for name, fn in items]


def test_at_least_three_mutants_per_exercise():
    from memlab.grading import load_all

    exercises = [e for e in load_all() if e.startswith("06.")]
    assert len(exercises) >= 6
    for e in exercises:
        assert len(mutants.MUTANTS.get(e, [])) >= 3, e


@pytest.mark.parametrize("exercise,name,fn", CASES, ids=[f"{e}-{n}" for e, n, _ in CASES])
def test_mutant_fails_its_check(exercise, name, fn):
    r = check(exercise, fn, quiet=True)
    assert r.status in ("fail", "error"), f"{exercise}: the wrong answer {name!r} got {r.status}"
