"""Differential cases: an exercise's input space, drawn with hypothesis, compared by the check's own relation.

The API (the whole harness's is in :mod:`memlab.course.grading.harness`'s docstring):

- ``Space(field=strategy, ..., where=predicate)``: the input space; a field is a strategy (:func:`ints`,
  :func:`floats`, :func:`one_of`, :func:`flags`, :func:`lists_of`, :func:`layouts`, or any hypothesis strategy), a constant,
  or a function of the fields before it (``lq=lambda c: ints(1, c.lk)``). Each case is a :class:`Case`
  with ``case.seed`` added for its values.
- ``differential(space, run, edges=[...], examples=N, seed=0)``: ``run(case)`` on every edge (the check's
  hand-picked cases), on a sweep that takes every option of each small field once and then pairs of options of
  two small fields not yet seen together (at most ``SWEEP_ROWS`` cases), then on N cases hypothesis
  draws (fixed seed, no database: the same cases on every
  machine; other ones on the harness's second pass). ``run`` raises AssertionError naming the case; a
  failure is shrunk (within :data:`SHRINK_BUDGET` runs) and the smallest case's error is raised, its message
  starting with that input (:func:`state_input`): ``on the smallest failing input found (n=1, seed=0): ...``.
- ``make_tensor(shape, dtype, layout, seed)``: values from a seed, in a memory layout of :data:`LAYOUTS`.
- ``current_pass()`` (0, or 1 on the second run), ``cases_run()`` (cases per exercise, for the report).
"""
from __future__ import annotations

import os

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = ["Space", "Case", "differential", "ints", "floats", "one_of", "flags", "lists_of", "layouts", "LAYOUTS",
           "make_tensor", "current_pass", "cases_run", "coverage", "running", "SHRINK_BUDGET", "failures", "drawn_only",
           "note_failure", "expect_prediction", "state_input"]

# the run in progress: which pass, which exercise, how many cases each exercise drew, which case failed where
_STATE: dict[str, Any] = {"pass": 0, "cases": {}, "exercise": None, "seen": {}, "failures": {}, "drawn_only": False}


def current_pass() -> int:
    """0 on the check's first run, 1 on the harness's second run (other seeds, fresh instances)."""
    return int(_STATE["pass"])


def cases_run() -> dict[str, int]:
    """Exercise id -> number of cases :func:`differential` ran for it (edges included) in this process."""
    return dict(_STATE["cases"])


def coverage() -> dict[str, dict[str, tuple[set[str], set[str] | None]]]:
    """Exercise id -> field -> (the values its drawn cases took, the values the space offers when they are a
    finite set, else None), as ``repr`` strings: which corners of the declared space the draws reached."""
    return {ex: {k: (set(v[0]), v[1]) for k, v in fields.items()} for ex, fields in _STATE["seen"].items()}


def failures() -> dict[str, tuple[str, str]]:
    """Exercise id -> (where the failing case came from: ``"edge"``, ``"sweep"`` or ``"drawn"``, ``repr`` of the
    case) for the last failure :func:`differential` saw in each exercise's first pass in this process: which part
    of the declared space caught an answer (tests/course/test_harness.py shows the drawn space catches each kind)."""
    return dict(_STATE["failures"])


@contextlib.contextmanager
def drawn_only() -> Iterator[None]:
    """Inside, :func:`differential` skips the declared edges (the hand-picked cases): only the sweep and the
    drawn cases run, to show that the space itself, not a case someone thought of, catches a wrong answer."""
    before = _STATE["drawn_only"]
    _STATE["drawn_only"] = True
    try:
        yield
    finally:
        _STATE["drawn_only"] = before


@contextlib.contextmanager
def running(exercise_id: str, pass_index: int) -> Iterator[None]:
    """Mark the checks run inside as ``exercise_id``'s pass ``pass_index`` (the harness's)."""
    _STATE["pass"], _STATE["exercise"] = pass_index, exercise_id
    if pass_index == 0:
        _STATE["failures"].pop(exercise_id, None)
    try:
        yield
    finally:
        _STATE["pass"], _STATE["exercise"] = 0, None


SHRINK_BUDGET = 60  # runs of the property while shrinking a failure (each runs the answer and the reference)
LAYOUTS = ("contiguous", "transposed", "strided", "offset", "channels_last")


class Case:
    """One drawn input: the space's fields as attributes (``case.n``, ``case.dtype``), ``case.seed`` for values.

    ``repr(case)`` is ``"n=7, dtype=torch.float16, seed=3"``: what a failure message shows."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return ", ".join(f"{k}={_show(v)}" for k, v in self.__dict__.items())

    def replace(self, **changes: Any) -> "Case":
        """A copy with some fields changed."""
        return Case(**{**self.__dict__, **changes})

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Case) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(tuple(sorted(repr(self).split(", "))))


def _show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, tuple) and v and all(isinstance(x, (int, float)) for x in v):
        return "(" + ", ".join(_show(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def _hypothesis() -> Any:
    from memlab.core.optional import needs

    with needs("the grader's differential cases (memlab grade)"):
        import hypothesis
        from hypothesis import strategies
        from hypothesis.configuration import set_hypothesis_home_dir
    # hypothesis keeps caches (its unicode tables) in ./.hypothesis of the current directory: a learner's
    # labs folder would gain one at every grading. They go to a folder of the temporary directory instead.
    import tempfile
    from pathlib import Path

    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"memlab-hypothesis-{os.getuid() if hasattr(os, 'getuid') else 0}")
    return hypothesis, strategies


def _simplest(strategy: Any, value: Any) -> Any:
    """``strategy``, remembering its simplest value (what the sweep gives a field it does not vary)."""
    if value is not None:
        strategy._memlab_simplest = value
    return strategy


def ints(lo: int, hi: int) -> Any:
    """Integers ``lo..hi`` (both included), about evenly spread over the range; shrinks toward ``lo``.

    (hypothesis's own ``integers`` favours the ends: with the few dozen cases a check draws, half were ``lo``.)"""
    st = _hypothesis()[1]
    return _simplest(st.sampled_from(range(lo, hi + 1)) if hi - lo <= 1 << 16 else st.integers(lo, hi), lo)


def floats(lo: float, hi: float, *, log: bool = False) -> Any:
    """Finite floats in ``[lo, hi]``; ``log=True`` draws the exponent uniformly (``lo > 0``: scales, rates)."""
    st = _hypothesis()[1]
    if log:
        import math

        return _simplest(st.floats(math.log(lo), math.log(hi)).map(lambda e: float(min(max(math.exp(e), lo), hi))), float(lo))
    return _simplest(st.floats(lo, hi, allow_nan=False, allow_infinity=False), float(lo))


def one_of(*values: Any) -> Any:
    """One of ``values`` (dtypes, names, configurations); shrinks toward the first."""
    return _simplest(_hypothesis()[1].sampled_from(list(values)), values[0])


def lists_of(element: Any, min_size: int = 0, max_size: int = 4) -> Any:
    """Lists (as tuples) of ``min_size`` to ``max_size`` elements drawn from ``element``; shrinks toward shorter."""
    first = getattr(element, "_memlab_simplest", None)
    return _simplest(_hypothesis()[1].lists(element, min_size=min_size, max_size=max_size).map(tuple),
                     (first,) * min_size if first is not None or min_size == 0 else None)


def flags() -> Any:
    """False or True; shrinks toward False."""
    return _simplest(_hypothesis()[1].booleans(), False)


def layouts(*names: str) -> Any:
    """Memory layouts for :func:`make_tensor` (default: all of :data:`LAYOUTS`); shrinks toward the first."""
    return one_of(*(names or LAYOUTS))


class Space:
    """An exercise's input space: named fields, each a hypothesis strategy (:func:`ints`, :func:`one_of`, ...),
    a constant, or a function of the fields before it returning one (``lq=lambda c: ints(1, c.lk)``).

    ``where`` keeps only the cases it accepts (use it for mild constraints). Every case also gets ``seed``
    (0..65535) for its values, unless the space declares one."""

    def __init__(self, *, where: Callable[[Case], bool] | None = None, **fields: Any) -> None:
        self.fields, self.where = fields, where

    def strategy(self, forced: dict[str, Any] | None = None) -> Any:
        """The hypothesis strategy of this space's cases (``forced``: fields held at a value)."""
        hyp, st = _hypothesis()
        fields, where = self.fields, self.where
        forced = forced or {}

        @st.composite
        def cases(draw: Any) -> Case:
            values: dict[str, Any] = {}
            for name, spec in fields.items():
                if name in forced:
                    values[name] = forced[name]
                    continue
                if callable(spec) and not isinstance(spec, st.SearchStrategy) and not isinstance(spec, type):
                    spec = spec(Case(**values))
                values[name] = draw(spec) if isinstance(spec, st.SearchStrategy) else spec
            if "seed" not in values:
                values["seed"] = draw(st.integers(0, 2**16 - 1))
            return Case(**values)

        s = cases()
        return s.filter(where) if where is not None else s


def _as_case(edge: Any) -> Case:
    if isinstance(edge, Case):
        return edge if "seed" in edge.__dict__ else edge.replace(seed=0)
    fields = dict(edge)
    fields.setdefault("seed", 0)
    return Case(**fields)


def differential(space: Space, run: Callable[[Case], Any], *, edges: Iterable[Any] = (), examples: int = 20,
                 seed: int = 0) -> int:
    """Call ``run(case)`` on every declared edge (dicts or :class:`Case`, first, in order; reversed on the
    second pass), on a sweep of cases that between them take every option of each small field and every pair of
    options of two small fields, as far as :data:`SWEEP_ROWS` allows (the other fields at their simplest; first
    pass only), then on ``examples`` cases hypothesis draws from ``space`` with a
    fixed seed (``seed`` on the first pass; on the second, :func:`current_pass`, a third as many from another
    seed). ``run`` raises AssertionError naming the
    case when the answer differs from the reference; a failure found by drawing is shrunk (within
    :data:`SHRINK_BUDGET` runs) and the smallest failing case's error is raised. Returns the number of cases run.
    """
    edges = [] if _STATE["drawn_only"] else [_as_case(e) for e in edges]
    count = 0
    for case in (edges if current_pass() == 0 else edges[::-1]):
        _noted("edge", run)(case)
        count += 1
    if examples > 0 and current_pass() == 0:
        for case in _sweep(space):  # every option of every small field, at least once
            try:
                _recorded(space, run)(case)
            except AssertionError as exc:  # made smaller where the space allows it, then stated
                if _is_hygiene(exc):  # a probe's finding names its call: as it was raised
                    _failed("sweep", case)
                    raise
                small, small_exc = _smaller(space, run, case, exc)
                _failed("sweep", small)
                raise state_input(small_exc, small, "the smallest failing input found") from None
            except BaseException:
                _failed("sweep", case)
                raise
            count += 1
    if current_pass() == 1 and examples > 0:  # the second run looks for state kept across calls: fewer, other cases
        examples = max(3, examples // 3)
    if examples > 0:
        count += _drawn(space, _recorded(space, run), examples, seed + 7919 * current_pass())
    ex = _STATE["exercise"]
    if ex is not None and current_pass() == 0:
        _STATE["cases"][ex] = _STATE["cases"].get(ex, 0) + count
    return count


def _smaller(space: Space, run: Callable[[Case], Any], case: Case, exc: AssertionError,
             budget: int = 16) -> tuple[Case, AssertionError]:
    """A smaller failing case than the swept ``case`` (hypothesis does not shrink a case it did not draw): greedily
    ``seed`` 0 (unless the space declares its own) and, in a space with no field computed from others, each
    small field's earlier options, within ``budget`` runs. Returns (the smallest failing case, its error)."""
    hyp, st = _hypothesis()
    fields = space.fields
    dependent = any(callable(v) and not isinstance(v, st.SearchStrategy) for v in fields.values())
    choices: list[tuple[str, list]] = [] if "seed" in fields else [("seed", [0])]
    if not dependent:
        choices += [(n, list(v.elements)) for n, v in fields.items()
                    if isinstance(v, st.SearchStrategy) and hasattr(v, "elements") and len(v.elements) <= 64]
    runs, improved = 0, True
    while improved and runs < budget:
        improved = False
        for name, options in choices:
            now = getattr(case, name, None)
            earlier = options[:options.index(now)] if now in options else (options if name == "seed" and now else [])
            for value in earlier:
                candidate = case.replace(**{name: value})
                if space.where is not None and not space.where(candidate):
                    continue
                runs += 1
                try:
                    run(candidate)
                except AssertionError as e:
                    if _is_hygiene(e):
                        return case, exc  # a probe's finding on a later call: the case found so far stands
                    case, exc, improved = candidate, e, True
                    break
                if runs >= budget:
                    return case, exc
    return case, exc


def _is_hygiene(exc: BaseException) -> bool:
    return type(exc).__name__ == "HygieneError"  # harness.HygieneError (the harness imports this module)


def state_input(exc: BaseException, case: Any, how: str = "input") -> BaseException:
    """``exc`` (a check's AssertionError) with the input it failed on at the start of its message:
    ``on <how> (<case>): <message>``, or ``on <how>: <message>`` when the message already shows the case (a
    hygiene probe's message is left as it is). Returns ``exc``, changed in place (its type and traceback kept)."""
    if not isinstance(exc, AssertionError) or _is_hygiene(exc) or getattr(exc, "_memlab_input", False):
        return exc
    text = str(exc.args[0]) if exc.args else ""
    shown = repr(case)
    exc.args = ((f"on {how}: {text}" if shown in text else f"on {how} ({shown}): {text}"), *exc.args[1:])
    exc._memlab_input = True  # type: ignore[attr-defined]
    return exc


def _noted(origin: str, run: Callable[[Case], Any]) -> Callable[[Case], Any]:
    """``run``, recording in :func:`failures` the case on which it raises (first pass only) and stating it in the
    error (:func:`state_input`)."""

    def noted(case: Case) -> Any:
        try:
            return run(case)
        except BaseException as exc:
            _failed(origin, case)
            raise state_input(exc, case, "the hand-picked input" if origin == "edge" else "input")

    return noted


def note_failure(case: Any, edges: Iterable[Any] = ()) -> None:
    """Record in :func:`failures` that ``case`` failed, for a check that draws its cases with :func:`differential`
    (``run=list.append``) and runs them later (on several processes at once): ``"edge"`` when it is one of
    ``edges``, else ``"drawn"`` (a swept case counts as drawn here)."""
    _failed("edge" if case in {_as_case(e) for e in edges} else "drawn", case)


def _failed(origin: str, case: Any) -> None:
    ex = _STATE["exercise"]
    if ex is not None and current_pass() == 0:
        _STATE["failures"][ex] = (origin, repr(case))


def _options(spec: Any) -> set[str] | None:
    """The values a field's strategy can take, when they are a finite set (one_of, flags), as reprs."""
    elements = getattr(spec, "elements", None)
    if elements is not None and len(elements) <= 64:
        return {repr(e) for e in elements}
    return {"False", "True"} if "booleans" in repr(spec) else None


SWEEP_OPTIONS = 8  # a field with at most this many options gets each of them in the sweep
SWEEP_ROWS = 24  # at most this many sweep cases: every option once, then as many pairs of options as fit


def _pairwise_rows(small: dict[str, list]) -> list[dict[str, int]]:
    """Option indices of the sweep's cases: first every option of each small field once (the fields in step), then,
    greedily, cases that pair options of two fields not yet seen together (a frozen layer in an MLP, not only in the
    TinyGPT the first rows happen to pair it with), until every pair is covered or :data:`SWEEP_ROWS` is reached.
    hypothesis's few dozen draws do not reach every pair: they are not independent uniform samples."""
    names = list(small)
    sizes = {n: len(small[n]) for n in names}
    uncovered = {(a, i, b, j) for x, a in enumerate(names) for b in names[x + 1:]
                 for i in range(sizes[a]) for j in range(sizes[b])}
    order = {n: x for x, n in enumerate(names)}

    def pair(a: str, i: int, b: str, j: int) -> tuple:
        return (a, i, b, j) if order[a] < order[b] else (b, j, a, i)

    def cover(row: dict[str, int]) -> None:
        for x, a in enumerate(names):
            for b in names[x + 1:]:
                uncovered.discard((a, row[a], b, row[b]))

    rows = [{n: k % sizes[n] for n in names} for k in range(max(sizes.values()))]
    for row in rows:
        cover(row)
    while uncovered and len(rows) < SWEEP_ROWS:
        a, i, b, j = min(uncovered, key=lambda t: (order[t[0]], t[1], order[t[2]], t[3]))
        row = {a: i, b: j}
        for n in names:
            if n not in row:
                row[n] = max(range(sizes[n]), key=lambda k: (sum(pair(m, v, n, k) in uncovered for m, v in row.items()), -k))
        rows.append({n: row[n] for n in names})
        cover(rows[-1])
    return rows


def _sweep(space: Space) -> list[Case]:
    """Cases that between them take every option of each small field (a dtype, a layout, a mode, a flag), the
    other fields at their simplest: hypothesis's random draws alone may miss a rare option in a few dozen cases."""
    hyp, st = _hypothesis()
    small = {name: list(spec.elements) if hasattr(spec, "elements") else [False, True]
             for name, spec in space.fields.items()
             if isinstance(spec, st.SearchStrategy) and (_options(spec) or set()) and len(_options(spec)) <= SWEEP_OPTIONS}
    if not small:
        return []
    out = []
    for i, row in enumerate(_pairwise_rows(small)):
        values: dict[str, Any] = {}
        for name, spec in space.fields.items():
            if name in small:
                values[name] = small[name][row[name]]
                continue
            if callable(spec) and not isinstance(spec, st.SearchStrategy):
                spec = spec(Case(**values))
            if isinstance(spec, st.SearchStrategy):
                simplest = getattr(spec, "_memlab_simplest", None)
                if simplest is None:
                    return _sweep_by_search(space, small)  # a field of hypothesis's own: let it find simple values
                values[name] = simplest
            else:
                values[name] = spec
        values.setdefault("seed", i)
        case = Case(**values)
        if space.where is None or space.where(case):
            out.append(case)
    return out


def _sweep_by_search(space: Space, small: dict[str, list]) -> list[Case]:
    hyp, st = _hypothesis()
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    config = settings(database=None, max_examples=50, deadline=None, derandomize=True, phases=[Phase.generate, Phase.shrink],
                      suppress_health_check=list(HealthCheck))
    out = []
    for row in _pairwise_rows(small):
        forced = {name: small[name][k] for name, k in row.items()}
        try:
            out.append(find(space.strategy(forced), lambda c: True, settings=config))
        except (NoSuchExample, hyp.errors.Unsatisfiable):
            continue  # the space's `where` refuses this combination
    return out


def _recorded(space: Space, run: Callable[[Case], Any]) -> Callable[[Case], Any]:
    ex = _STATE["exercise"]
    if ex is None or current_pass() != 0:
        return run
    seen = _STATE["seen"].setdefault(ex, {})

    def recording(case: Case) -> Any:
        for name, value in vars(case).items():
            spec = space.fields.get(name)
            entry = seen.setdefault(name, (set(), _options(spec) if spec is not None and not callable(spec) else None))
            entry[0].add(repr(value))
        return run(case)

    return recording


def _drawn(space: Space, run: Callable[[Case], Any], examples: int, seed: int) -> int:
    hyp, st = _hypothesis()
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.errors import Flaky
    from hypothesis.reporting import with_reporter

    failing: dict[str, BaseException] = {}
    runs = {"all": 0, "after_failure": 0}

    last: list[Case] = []  # the last case that failed: hypothesis replays the smallest one at the end

    def prop(case: Case) -> None:
        key = repr(case)
        if failing and key not in failing:
            runs["after_failure"] += 1
            if runs["after_failure"] > SHRINK_BUDGET:
                return  # out of budget: a case not seen failing is taken as passing; shrinking ends
        runs["all"] += 1
        try:
            run(case)
        except Exception as exc:
            failing.setdefault(key, exc)
            last[:] = [case]
            raise

    test = settings(max_examples=examples, database=None, deadline=None, derandomize=False,
                    suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
                    report_multiple_bugs=False, print_blob=False, verbosity=Verbosity.quiet)(
        fixed_seed(seed)(given(space.strategy())(prop)))
    try:
        with with_reporter(lambda *a, **k: None):
            test()
    except Flaky:
        _failed("drawn", next(iter(failing)))
        first = next(iter(failing.values()))
        raise AssertionError(f"{first} (and on the same input again it did not fail: the answer depends on "
                             f"earlier calls)") from None
    except BaseException as exc:
        if failing:
            _failed("drawn", last[0] if last else min(failing, key=len))  # the smallest failing case found
        if hasattr(exc, "__notes__"):
            exc.__notes__ = [n for n in exc.__notes__ if "Falsifying" not in n and "hypothesis" not in n.lower()]
        if last:
            raise state_input(exc, last[0], "the smallest failing input found")
        raise
    return runs["all"]


def make_tensor(shape: Sequence[int], dtype: Any = None, layout: str = "contiguous", seed: int = 0, *,
                scale: float = 1.0, low: int = 0, high: int = 16, device: Any = "cpu") -> Any:
    """A tensor of ``shape`` and ``dtype`` (default float32) in memory ``layout`` (:data:`LAYOUTS`), its
    values from ``seed``: normal x ``scale`` for floating dtypes, uniform integers in ``[low, high)`` for
    integer ones (bool: coin flips). ``"transposed"`` stores the last two dimensions swapped,
    ``"strided"`` every other element of a twice-as-long last dimension, ``"offset"`` starts 3 elements
    into its storage, ``"channels_last"`` is a 4-D tensor in NHWC order (other ranks: contiguous);
    on ``device="meta"`` only the shape and dtype are real."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    shape = tuple(int(s) for s in shape)
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    gen = torch.Generator().manual_seed(int(seed))

    def values(sh: tuple[int, ...]) -> Any:
        if dtype == torch.bool:
            return torch.randint(0, 2, sh, generator=gen).bool()
        if dtype.is_floating_point or dtype.is_complex:
            return (torch.randn(sh, generator=gen, dtype=torch.float64) * scale).to(dtype)
        return torch.randint(low, high, sh, generator=gen).to(dtype)

    if layout == "transposed" and len(shape) >= 2:
        t = values(shape[:-2] + (shape[-1], shape[-2])).transpose(-1, -2)
    elif layout == "strided" and len(shape) >= 1:
        t = values(shape[:-1] + (2 * shape[-1],))[..., ::2]
    elif layout == "offset":
        n = 1
        for s in shape:
            n *= s
        t = values((n + 3,))[3:].view(shape)
    elif layout == "channels_last" and len(shape) == 4:
        t = values(shape).contiguous(memory_format=torch.channels_last)
    elif layout in LAYOUTS:
        t = values(shape)
    else:
        raise ValueError(f"layout={layout!r} is not a memory layout; allowed: {', '.join(LAYOUTS)}")
    return t.to(device)


def expect_prediction(where: str, got: Any, model: float, measure: Callable[[], float], tolerance: float,
                      hint: str = "") -> None:
    """The relation of a predict-then-measure exercise on a drawn case: ``got`` is a positive Python number within
    ``tolerance`` (relative) of memlab's model of the quantity, ``model``, or of the measurement, ``measure()``
    (run only when the model's value is missed: measuring costs a real step).

    Either of two right answers is accepted, each with the check's tolerance and no wider: memlab's model (what
    the lab teaches) is exact to within the tolerance on the hand-picked cases, which the check compares with the
    measurement alone, but on a drawn case it may be further off (a size it does not model), and a learner whose
    prediction is closer to the measurement must pass there too. AssertionError names both and ``hint``."""
    if type(got) not in (int, float) or not got > 0:
        raise AssertionError(f"{where}: expected a positive number of bytes (a Python int or float), got "
                             f"{type(got).__name__} {str(got)[:60]}")
    err = float(got) / model - 1
    if abs(err) <= tolerance:
        return
    measured = measure()
    err_m = float(got) / measured - 1
    if abs(err_m) > tolerance:
        raise AssertionError(f"{where}: predicted {float(got):,.0f} B, measured {measured:,.0f} B ({err_m:+.1%}), "
                             f"memlab's model {model:,.0f} B ({err:+.1%}); allowed +-{tolerance:.1%} of either. {hint}")
