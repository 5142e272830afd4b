"""Every plausible wrong answer in tests/course/mutants/chNN.py FAILS its check (DESIGN.md, "Mutation tests").

Each chapter with graded exercises has a tests/course/mutants/chNN.py whose MUTANTS maps an exercise id to
(name, wrong implementation) pairs: at least three per exercise.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from memlab.course.grading import check, load_all

MUTANTS_DIR = Path(__file__).parent / "mutants"
CHAPTERS = sorted({e.split(".")[0] for e in load_all()})


def _load(chapter: str):
    path = MUTANTS_DIR / f"ch{chapter}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"memlab_mutants_ch{chapter}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MODULES = {ch: _load(ch) for ch in CHAPTERS}
CASES = [(ex, name, fn) for mod in MODULES.values() if mod is not None
         for ex, items in mod.MUTANTS.items() for name, fn in items]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_has_three_mutants(chapter):
    mod = MODULES[chapter]
    assert mod is not None, f"tests/course/mutants/ch{chapter}.py is missing"
    exercises = [e for e in load_all() if e.startswith(chapter + ".")]
    assert 3 <= len(exercises) <= 6, f"chapter {chapter}: {len(exercises)} exercises; a lab has 3 to 6"
    for e in exercises:
        assert len(mod.MUTANTS.get(e, [])) >= 3, f"{e}: fewer than three mutants"
    unknown = set(mod.MUTANTS) - set(exercises)
    assert not unknown, f"tests/course/mutants/ch{chapter}.py names exercises that do not exist: {sorted(unknown)}"


@pytest.mark.parametrize("exercise,name,fn", CASES, ids=[f"{e}-{n}" for e, n, _ in CASES])
def test_mutant_fails_its_check(exercise, name, fn):
    r = check(exercise, fn, quiet=True)
    assert r.status in ("fail", "error"), f"{exercise}: the wrong answer {name!r} got {r.status}"
