"""Every plausible wrong answer in tests/course/mutants/chNN.py FAILS its check (DESIGN.md, "Mutation tests").

Each chapter with graded exercises has a tests/course/mutants/chNN.py whose MUTANTS maps an exercise id to
(name, wrong implementation) pairs: at least three per exercise.

A module may also declare, for the kinds of mistake of issue 35 (read here from whichever modules declare them):

- ``KINDS = {exercise: {kind: [mutant names]}}``, kind one of ``"hygiene"`` (inputs changed, state shared across
  calls or instances, references kept), ``"constants"`` (a constant tuned to the graded inputs) and ``"space"``
  (a part of the input space handled wrong): a hygiene mutant must be caught by a hygiene probe, a constants or
  space mutant by the declared space itself, its drawn cases with the hand-picked edges switched off;
- ``NOT_APPLICABLE = {exercise: {kind: why}}``: in a module that declares KINDS, every exercise of the chapter
  has a mutant of every kind, unless it says here why the kind does not apply;
- ``RIGHT_ANSWERS = {exercise: [(name, right answer written another way)]}``: the fourth kind, an over-specific
  check, is a right answer that fails; each of these must pass.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from memlab.course.grading import cases, check, load_all

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


KIND_NAMES = ("hygiene", "constants", "space")
KINDED = [(ex, kind, name) for mod in MODULES.values() if mod is not None
          for ex, kinds in getattr(mod, "KINDS", {}).items() for kind, names in kinds.items() for name in names]
RIGHT = [(ex, name, fn) for mod in MODULES.values() if mod is not None
         for ex, items in getattr(mod, "RIGHT_ANSWERS", {}).items() for name, fn in items]


def _mutants(exercise: str, name: str) -> list:
    mod = MODULES[exercise.split(".")[0]]
    found = [fn for n, fn in mod.MUTANTS.get(exercise, []) if n == name]
    assert found, f"{exercise}: KINDS names {name!r}, which is not a mutant of MUTANTS"
    return found


@pytest.mark.parametrize("chapter", [c for c in CHAPTERS if MODULES[c] is not None and hasattr(MODULES[c], "KINDS")])
def test_every_exercise_has_a_mutant_of_each_kind_that_applies(chapter):
    mod = MODULES[chapter]
    skip = getattr(mod, "NOT_APPLICABLE", {})
    missing = []
    for e in (e for e in load_all() if e.startswith(chapter + ".")):
        kinds = mod.KINDS.get(e, {})
        assert set(kinds) <= set(KIND_NAMES), f"{e}: unknown kinds {sorted(set(kinds) - set(KIND_NAMES))}"
        for kind in KIND_NAMES:
            if not kinds.get(kind) and kind not in skip.get(e, {}):
                missing.append(f"{e}: no {kind} mutant (and no NOT_APPLICABLE reason)")
    assert not missing, missing


@pytest.mark.parametrize("exercise,kind,name", KINDED, ids=[f"{e}-{k}-{n}" for e, k, n in KINDED])
def test_each_kind_is_caught_by_its_mechanism(exercise, kind, name):
    """A hygiene mistake by a hygiene probe; a constant tuned to the graded inputs or a part of the input space
    handled wrong by the declared space: with the hand-picked edges off, a swept or drawn case fails."""
    for fn in _mutants(exercise, name):
        if kind == "hygiene":
            r = check(exercise, fn, quiet=True)
            assert r.status == "fail" and "hygiene (" in r.message, f"{exercise}: {name!r} got {r.status}: {r.message[:300]}"
            continue
        with cases.drawn_only():
            r = check(exercise, fn, quiet=True)
        origin = cases.failures().get(exercise)
        assert r.status in ("fail", "error") and origin is not None and origin[0] in ("sweep", "drawn"), (
            f"{exercise}: {name!r} ({kind}) with the edges off: {r.status}, caught by {origin}: {r.message[:300]}")


@pytest.mark.parametrize("exercise,name,fn", RIGHT, ids=[f"{e}-{n}" for e, n, _ in RIGHT])
def test_right_answers_written_another_way_pass(exercise, name, fn):
    r = check(exercise, fn, quiet=True)
    assert r.status == "pass", f"{exercise}: the right answer {name!r} got {r.status}: {r.message[:300]}"
    # and its points: an own answer is not taken for memlab's reference (issue 41.4's provenance looks)
    assert r.points == r.max_points and r.message == "", f"{exercise}: the right answer {name!r}: {r.message[:300]}"
