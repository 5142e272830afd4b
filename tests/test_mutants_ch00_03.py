"""Every plausible wrong answer in tests/mutants/ch00.py .. ch03.py FAILS its check (DESIGN.md)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from memlab.grading import check, load_all

CHAPTERS = ["ch00", "ch01", "ch02", "ch03"]


def _load(ch: str):
    path = Path(__file__).parent / "mutants" / f"{ch}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"memlab_mutants_{ch}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MODULES = {ch: _load(ch) for ch in CHAPTERS}
CASES = [(ex, name, fn) for mod in MODULES.values() if mod is not None
         for ex, items in mod.MUTANTS.items() for name, fn in items]


@pytest.mark.parametrize("ch", CHAPTERS)
def test_at_least_three_mutants_per_exercise(ch):
    mod = MODULES[ch]
    assert mod is not None, f"tests/mutants/{ch}.py is missing"
    exercises = [e for e in load_all() if e.startswith(ch[2:] + ".")]
    assert exercises, ch
    for e in exercises:
        assert len(mod.MUTANTS.get(e, [])) >= 3, f"{e}: fewer than three mutants"


@pytest.mark.parametrize("exercise,name,fn", CASES, ids=[f"{e}-{n}" for e, n, _ in CASES])
def test_mutant_fails_its_check(exercise, name, fn):
    r = check(exercise, fn, quiet=True)
    assert r.status in ("fail", "error"), f"{exercise}: the wrong answer {name!r} got {r.status}"
