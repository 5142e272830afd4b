"""The grading harness (memlab.course.grading.harness): its snapshots, each hygiene probe on real exercises, the
differential cases, and, for each kind of mistake the probes exist for, that the probe catches it on every exercise
it applies to (wrong answers derived from memlab's own reference, so no exercise is left out)."""
from __future__ import annotations

import contextlib
import functools
import types

import pytest
import torch
from torch import nn

from memlab.course.grading import check, harness, load_all

REGISTRY = load_all()


# ----------------------------------------------------------------------------- snapshots
def _changed(x, edit) -> str | None:
    before = harness.snapshot(x)
    edit(x)
    return harness.difference(before, harness.snapshot(x), "x")


def test_snapshot_sees_values_layout_and_the_storage_outside_a_view():
    base = torch.arange(12.0)
    view = base[4:8]
    assert _changed(view, lambda t: None) is None
    assert "values changed" in _changed(view, lambda t: base[0].add_(1))  # outside the view, inside its storage
    assert "values changed" in _changed(torch.ones(3), lambda t: t.data.mul_(2))  # .data bypasses the version counter
    assert "stride" in _changed(torch.ones(2, 3), lambda t: t.as_strided_((2, 3), (1, 2)))
    assert "requires_grad" in _changed(torch.ones(2), lambda t: t.requires_grad_(True))
    leaf = torch.ones(2, requires_grad=True)
    assert "gained a .grad" in _changed(leaf, lambda t: t.sum().backward())
    nan = torch.tensor([float("nan"), 1.0])
    assert _changed(nan, lambda t: None) is None  # bytes, not ==: a NaN is equal to itself
    assert _changed(torch.empty(2, 2, device="meta"), lambda t: None) is None


def test_snapshot_sees_containers_modules_and_optimizers():
    assert "length changed from 3 to 2" in _changed([nn.Linear(2, 2) for _ in range(3)], lambda xs: xs.pop(0))
    assert "keys changed" in _changed({"a": torch.ones(1)}, lambda d: d.update(b=1))
    lin = nn.Linear(3, 3)
    assert "hook(s) left installed" in _changed(lin, lambda m: m.register_forward_hook(lambda *a: None))
    assert "weight" in _changed(nn.Linear(3, 3), lambda m: m.weight.data.zero_())
    assert "training flag" in _changed(nn.Linear(3, 3), lambda m: m.eval())
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)

    def step(o):
        o.step()

    assert _changed(opt, step) is not None


# ----------------------------------------------------------------------------- each probe on a real exercise
def test_inputs_unchanged_names_the_probe_the_argument_and_the_call():
    ref = REGISTRY["05.merge_partials"].reference()

    def merge_into_o1(o1, lse1, o2, lse2):
        o, lse = ref(o1, lse1, o2, lse2)
        o1.copy_(o)  # "merging the partials into o1": the caller's tensor overwritten
        return o1.clone(), lse

    r = check("05.merge_partials", merge_into_o1, quiet=True)
    assert r.status == "fail" and "hygiene (inputs unchanged)" in r.message, r
    assert "call #1" in r.message and "argument o1" in r.message, r


def test_declared_mutations_are_allowed_and_the_others_are_not():
    ref = REGISTRY["04.adamw_update"].reference()

    def scratch_grad(param, grad, exp_avg, exp_avg_sq, step, **hp):
        ref(param, grad, exp_avg, exp_avg_sq, step, **hp)
        grad.zero_()  # "reusing the gradient as scratch": grad is not declared mutated

    r = check("04.adamw_update", scratch_grad, quiet=True)
    assert r.status == "fail" and "argument grad" in r.message and "inputs unchanged" in r.message, r


# objects the class and global probe pictures by identity only (a library's type): what is kept in them is seen
# by the probe under test, not by that one
HOLD = types.SimpleNamespace(buffer=torch.empty(4096, dtype=torch.uint8), kept=[])


def test_a_buffer_returned_by_every_call_is_a_shared_result():
    ref = REGISTRY["06.pack_nibbles"].reference()

    def pack_into_a_kept_buffer(codes):  # "a buffer cached by size": each call's answer overwrites the last one
        packed = ref(codes)
        out = HOLD.buffer[: packed.numel()]
        out.copy_(packed)
        return out

    r = check("06.pack_nibbles", pack_into_a_kept_buffer, quiet=True)
    assert r.status == "fail" and "hygiene (no shared result)" in r.message and "call #2" in r.message, r


@functools.lru_cache(maxsize=None)
def cached_codebook(offset=None):  # a notebook's global, as a learner writes it
    return REGISTRY["06.nf4_codebook"].reference()(offset)


def test_an_lru_cache_of_tensors_is_found():
    r = check("06.nf4_codebook", cached_codebook, quiet=True)
    # the same offset asked twice gets the same tensor back, or (asked once each) the cache keeps them alive
    assert r.status == "fail" and ("hygiene (no shared result)" in r.message or
                                   "hygiene (nothing kept alive)" in r.message and "cached_codebook" in r.message), r


KEPT: list = []


def test_a_reference_kept_in_a_global_is_found():
    ref = REGISTRY["02.checkpoint_function"].reference()

    def keeps_inputs(fn, *args):
        HOLD.kept.append(args)
        return ref(fn, *args)

    try:
        r = check("02.checkpoint_function", keeps_inputs, quiet=True)
    finally:
        HOLD.kept.clear()
    assert r.status == "fail" and "hygiene (nothing kept alive)" in r.message and "the global 'HOLD'" in r.message, r
    # kept in a global list the answer names, the class and global probe sees it first, at the call
    def keeps_in_a_list(fn, *args):
        KEPT.append(args)
        return ref(fn, *args)

    try:
        r = check("02.checkpoint_function", keeps_in_a_list, quiet=True)
    finally:
        KEPT.clear()
    assert r.status == "fail" and "hygiene (no class or global state): call #1" in r.message and "KEPT" in r.message, r


class CountedRNG:
    """A right RNG snapshot, except that every instance is also counted on the class."""

    made: list = []

    def __init__(self):
        self.state = torch.get_rng_state()
        CountedRNG.made.append(len(CountedRNG.made))

    @contextlib.contextmanager
    def replay(self):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            torch.set_rng_state(outer)


def test_class_attributes_that_change_are_state():
    r = check("02.rng_replay", CountedRNG, quiet=True)
    assert r.status == "fail" and "hygiene (no class or global state)" in r.message, r
    assert "CountedRNG.made" in r.message, r


CALLS: dict = {}


def test_globals_that_change_are_state():
    ref = REGISTRY["00.activation_bytes"].reference()

    def counted(*args, **kwargs):
        CALLS[args] = CALLS.get(args, 0) + 1
        return ref(*args, **kwargs)

    r = check("00.activation_bytes", counted, quiet=True)
    assert r.status == "fail" and "global CALLS" in r.message, r


# ----------------------------------------------------------------------------- differential cases
from memlab.course.grading import cases as C  # noqa: E402

SPACE = C.Space(n=C.ints(1, 64), dtype=C.one_of(torch.float32, torch.float16, torch.bfloat16), layout=C.layouts(),
                k=lambda c: C.ints(1, c.n))


def _drawn(p: int = 0, examples: int = 25) -> list:
    seen: list = []
    with C.running("99.example", p):
        C.differential(SPACE, seen.append, edges=[dict(n=3, dtype=torch.float32, layout="contiguous", k=1)],
                       examples=examples)
    return seen


def test_cases_are_the_same_on_every_run_and_other_ones_on_the_second_pass():
    first, again, second = _drawn(0), _drawn(0), _drawn(1)
    assert first == again and first[0] == C.Case(n=3, dtype=torch.float32, layout="contiguous", k=1, seed=0)
    assert first[1:] != second[1:]
    assert all(1 <= c.k <= c.n for c in first) and len({c.layout for c in first}) > 2
    assert C.cases_run()["99.example"] >= 2 * len(first)


def test_a_failure_is_shrunk_to_a_small_case_within_a_budget():
    runs = []

    def run(c):
        runs.append(c)
        assert not (c.n >= 9 and c.dtype == torch.float16), f"differs on {c}"

    with pytest.raises(AssertionError) as err:
        C.differential(SPACE, run, examples=40)
    assert "n=9, dtype=torch.float16, layout='contiguous', k=1, seed=0" in str(err.value)
    assert str(err.value).startswith("on the smallest failing input found: differs on n=9"), str(err.value)
    assert len(runs) <= 40 + C.SHRINK_BUDGET + 5


def test_a_fail_row_states_the_smallest_input_on_which_the_answer_differs():
    """Issue 40.6: the FAIL message starts with the shrunk input (the check's own message said only the call),
    a hand-picked input is named as such, and a case run in other processes (08's ranks) states its input too."""
    from memlab import accounting
    from memlab.course.grading import check

    def model_state_bytes(n_params, recipe="fp32-adamw"):  # wrong for SGD from 1,234 parameters up to 2**31
        r = accounting.RECIPES[recipe]
        out = {"weights": int(r.weights * n_params), "gradients": int(r.gradients * n_params),
               "optimizer": int(r.optimizer * n_params) + (1234 <= n_params < 2**31 and recipe == "fp32-sgd")}
        out["total"] = sum(out.values())
        return out

    r = check("00.model_state_bytes", model_state_bytes, quiet=True)
    assert r.status == "fail", r
    assert r.message.startswith("on the smallest failing input found (n='small', m=1234, recipe='fp32-sgd', seed=0): "), r.message

    def no_message(case):
        raise AssertionError("got 1, expected 0")

    with C.running("99.edge", 0), pytest.raises(AssertionError, match=r"^on the hand-picked input \(n=3, k=1, seed=0\): got 1"):
        C.differential(C.Space(n=C.ints(1, 9), k=1), no_message, edges=[dict(n=3, k=1)], examples=3)

    from memlab.course.checks import ch08

    case = C.Case(numel=7, ws=3, seed=5)
    with pytest.raises(AssertionError, match=r"^on the smallest failing input of those run on the ranks "
                                             r"\(numel=7, ws=3, seed=5\): rank 1 differs"):
        ch08._judged(case, [], lambda c: (_ for _ in ()).throw(AssertionError("rank 1 differs")))


def test_an_answer_that_depends_on_earlier_calls_is_named():
    calls = []

    def run(c):
        calls.append(c)
        assert len(calls) % 2 or c.n < 20, f"differs on {c}"  # fails every other time on large n

    with pytest.raises(AssertionError, match="depends on earlier calls|differs on"):
        C.differential(SPACE, run, examples=40)


def test_the_sweep_pairs_the_options_of_every_two_small_fields():
    """A wrong answer that shows only on one combination (a frozen layer in an MLP) is met by the sweep, not left to
    hypothesis's draws, which are not independent uniform samples and paired a flag with one model only."""
    space = C.Space(model=C.one_of("mlp", "tinygpt"), dtype=C.one_of(torch.float32, torch.float16, torch.bfloat16),
                    frozen=C.flags(), tied=C.flags(), n=C.ints(1, 50))
    seen: list = []
    with C.running("99.pairs", 0):
        C.differential(space, seen.append, examples=1)
    seen = seen[:-1]  # the sweep's cases (the last one is hypothesis's draw)
    pairs = {(a, getattr(c, a), b, getattr(c, b)) for c in seen for a in ("model", "dtype", "frozen", "tied")
             for b in ("model", "dtype", "frozen", "tied") if a < b}
    assert len(pairs) == 2 * 3 + 2 * 2 * 2 + 3 * 2 * 2 + 2 * 2, sorted(pairs, key=repr)  # every pair of options
    assert len(seen) <= C.SWEEP_ROWS and all(c.n == 1 for c in seen)  # the other fields at their simplest


@pytest.mark.parametrize("layout", C.LAYOUTS)
def test_make_tensor_layouts(layout):
    t = C.make_tensor((2, 3, 4, 5), torch.float16, layout, seed=1)
    assert t.shape == (2, 3, 4, 5) and t.dtype == torch.float16
    assert torch.equal(t, C.make_tensor((2, 3, 4, 5), torch.float16, layout, seed=1))
    contiguous = layout in ("contiguous", "offset")
    assert t.is_contiguous() == contiguous
    assert (t.storage_offset() == 3) == (layout == "offset")
    ints = C.make_tensor((3, 4), torch.int64, layout, seed=2, low=-5, high=5)
    assert ints.min() >= -5 and ints.max() < 5
    assert C.make_tensor((3, 4), torch.bfloat16, layout, device="meta").device.type == "meta"


# ----------------------------------------------------------------------------- each kind, on every exercise
# Wrong answers derived from memlab's own reference for every exercise at once: the reference with one mistake of
# a kind added. Each must fail, and by the probe that exists for that kind, wherever the kind applies.
import inspect  # noqa: E402
import sys  # noqa: E402

DISTRIBUTED = {"08.reduce_scatter", "08.zero1_step"}  # called inside forked ranks: the parent's probes see the failure
MINE = {e: x for e, x in REGISTRY.items() if e[:2] <= "08"}  # chapter 09 ports to the harness on its own
FUNCTIONS = sorted(e for e, x in MINE.items() if not isinstance(x.reference(), type)
                   and isinstance(x.reference(), (types.FunctionType, functools.partial)))
CLASSES = sorted(e for e, x in MINE.items() if isinstance(x.reference(), type))
HELD: list = []
COUNTS: dict = {}


def _bound(ex, args, kwargs):
    try:
        return list(inspect.signature(ex.reference()).bind(*args, **kwargs).arguments.items())
    except TypeError:
        return [(str(i), a) for i, a in enumerate(args)]


def _scribble(value) -> bool:
    """Change ``value`` (a tensor, a list, a module) in place; whether there was something to change."""
    if isinstance(value, torch.Tensor) and value.dtype != torch.bool and value.numel() and value.device.type != "meta" \
            and type(value).__name__ != "FakeTensor":
        with torch.no_grad():
            value[(0,) * value.dim()] += 1  # one element, in the caller's memory
        return True
    if type(value) is list and value:
        value.pop()
        return True
    if isinstance(value, nn.Module) and any(True for _ in value.parameters()):
        with torch.no_grad():
            next(value.parameters()).add_(1)
        return True
    return False


def _mutating(ex):
    ref, done = ex.reference(), []

    def answer(*args, **kwargs):
        out = ref(*args, **kwargs)
        if not done:
            for name, value in _bound(ex, args, kwargs):
                if name not in ex.mutates and _scribble(value):
                    done.append(name)
                    break
        return out

    return answer, done


def _keeping(ex):
    ref = ex.reference()

    def answer(*args, **kwargs):
        out = ref(*args, **kwargs)
        HELD.append(args)  # "kept for a plot later": a module-level list
        HELD.append(out)
        return out

    return answer


def _counting(ex):
    ref = ex.reference()

    def answer(*args, **kwargs):
        COUNTS[ex.id] = COUNTS.get(ex.id, 0) + 1  # a module-level counter of the calls
        return ref(*args, **kwargs)

    return answer


@pytest.mark.parametrize("exercise", FUNCTIONS)
def test_inputs_changed_in_place_fail_on_every_exercise(exercise):
    ex = REGISTRY[exercise]
    answer, done = _mutating(ex)
    r = check(exercise, answer, quiet=True)
    if exercise in DISTRIBUTED:  # in the ranks: ``done`` is the child's; the tensor arguments are the ones not declared
        tensors = set(inspect.signature(ex.reference()).parameters) - set(ex.mutates) - {"group"}
        assert (r.status == "fail" and "hygiene (inputs unchanged)" in r.message) if tensors else r.status == "pass", r
    elif done:
        assert r.status == "fail" and "hygiene (inputs unchanged)" in r.message and f"argument {done[0]}" in r.message, r
    else:  # nothing to change in place (numbers, a config, a callable): the kind does not apply
        assert r.status == "pass", r


# where keeping a reference changes what the check itself measures, the check fails first (the probe is not reached)
SEEN_BY_THE_CHECK = {"01.categorize": "the tracker sees the kept storages alive"}


@pytest.mark.parametrize("exercise", sorted(set(FUNCTIONS) - DISTRIBUTED))
def test_references_kept_alive_fail_on_every_exercise(exercise):
    note = types.SimpleNamespace(applies=False)  # the test's own record: an object the probes picture by identity
    ex = REGISTRY[exercise]
    ref = ex.reference()

    def answer(*args, **kwargs):
        out = ref(*args, **kwargs)
        kept = [a for a in (*args, *kwargs.values(), out) if isinstance(a, (torch.Tensor, nn.Module)) or
                (isinstance(a, (list, tuple)) and any(isinstance(x, (torch.Tensor, nn.Module)) for x in a))]
        if any(isinstance(a, torch.Tensor) and (a.device.type == "meta" or type(a).__name__ == "FakeTensor")
               for a in kept):
            kept = []
        if kept:
            HOLD.kept.append(kept)  # "kept for a plot later", in a holder the state probe pictures by identity
            note.applies = True
        return out

    try:
        r = check(exercise, answer, quiet=True)
    finally:
        HOLD.kept.clear()
    if exercise in SEEN_BY_THE_CHECK:
        assert r.status == "fail", r
    elif note.applies:
        assert r.status == "fail" and "hygiene (nothing kept alive)" in r.message and "HOLD" in r.message, r
    else:  # only numbers, configs or callables pass through: the kind does not apply
        assert r.status == "pass", r


@pytest.mark.parametrize("exercise", sorted(set(FUNCTIONS) - DISTRIBUTED))
def test_global_state_fails_on_every_exercise(exercise):
    r = check(exercise, _counting(REGISTRY[exercise]), quiet=True)
    assert r.status == "fail" and "hygiene (no class or global state)" in r.message and "COUNTS" in r.message, r


def _class_with_a_registry(ref: type) -> type:
    """The reference class, except that every call of one of its methods is also appended to a class-level list."""
    ns: dict = {"log": []}
    for name, value in vars(ref).items():
        fn = value.__func__ if isinstance(value, staticmethod) else value
        if name.startswith("__") and name not in ("__init__", "__call__") or not isinstance(fn, types.FunctionType):
            continue

        def logged(*args, _fn=fn, _name=name, **kwargs):
            ns_cls.log.append(_name)
            return _fn(*args, **kwargs)

        ns[name] = staticmethod(logged) if isinstance(value, staticmethod) else logged
    ns_cls = type(f"Logged{ref.__name__}", (ref,), ns)
    return ns_cls


@pytest.mark.parametrize("exercise", CLASSES)
def test_class_state_fails_on_every_class_exercise(exercise):
    r = check(exercise, _class_with_a_registry(REGISTRY[exercise].reference()), quiet=True)
    assert r.status == "fail" and "hygiene (no class or global state)" in r.message and ".log" in r.message, r


# ----------------------------------------------------------------------------- the input space, reached
def test_each_ported_exercise_draws_every_corner_of_its_declared_space():
    """Constants tuned to the graded inputs and an input space not covered are caught by the declared space: every
    option of each small field (a dtype, a layout, a mode, a flag) is drawn, and every other field takes several
    values, in one run of the reference's check."""
    ported = []
    for exercise, ex in MINE.items():
        if any("differential(" in inspect.getsource(fn) for fn in ex.checks):
            check(exercise, ex.reference(), quiet=True)
    missed = []
    for exercise, fields in C.coverage().items():
        if exercise not in MINE:
            continue
        ported.append(exercise)
        for field, (seen, options) in fields.items():
            if options is not None and len(options) <= 8:
                if not seen >= options:
                    missed.append(f"{exercise}: field {field!r} never drew {sorted(options - seen)}")
            elif field != "seed" and len(seen) < 2:
                missed.append(f"{exercise}: field {field!r} drew only {seen}")
    assert not missed, missed
    assert len(ported) >= 14, ported


def test_a_fail_row_from_the_kernel_states_the_smallest_input(tmp_path):
    """The same statement when `memlab grade` runs the check inside the notebook's kernel (issue 40.6)."""
    import nbformat

    from memlab.course.grading import grade_notebook

    answer = ("from memlab import accounting\n"
              "def model_state_bytes(n_params, recipe='fp32-adamw'):\n"
              "    r = accounting.RECIPES[recipe]\n"
              "    out = {'weights': int(r.weights * n_params), 'gradients': int(r.gradients * n_params),\n"
              "           'optimizer': int(r.optimizer * n_params) + (1234 <= n_params < 2**31 and recipe == 'fp32-sgd')}\n"
              "    out['total'] = sum(out.values())\n    return out")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in
                ("from memlab.course.grading import check", answer, "check('00.model_state_bytes', model_state_bytes)")]
    path = tmp_path / "00_shrunk.ipynb"
    nbformat.write(nb, path)
    rows = {r.exercise: r for r in grade_notebook(path, timeout=120)}
    row = rows["00.model_state_bytes"]
    assert row.status == "fail", row
    assert row.message.startswith("on the smallest failing input found (n='small', m=1234, recipe='fp32-sgd', seed=0): "), row.message


def test_a_failing_swept_case_is_made_smaller_before_it_is_stated():
    """Hypothesis shrinks only what it draws; a case of the sweep that fails is made smaller by the harness (its
    seed, and in a space with no computed field, earlier options of the small fields) and stated as such."""
    space = C.Space(dtype=C.one_of(torch.float32, torch.float16, torch.bfloat16), layout=C.layouts(), n=C.ints(1, 50))

    def run(c):
        if c.dtype != torch.float32 and c.layout == "strided":  # (no assert: pytest would show the case itself)
            raise AssertionError(f"differs for {c.dtype} in a strided layout")

    with C.running("99.sweep", 0), pytest.raises(AssertionError) as err:
        C.differential(space, run, examples=5)
    assert str(err.value).startswith("on the smallest failing input found (dtype=torch.float16, layout='strided', "
                                     "n=1, seed=0): differs"), str(err.value)
    assert C.failures()["99.sweep"] == ("sweep", "dtype=torch.float16, layout='strided', n=1, seed=0")
