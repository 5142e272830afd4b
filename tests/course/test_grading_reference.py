"""The grader judges what an answer computes, not whether it names memlab's reference (issue 41, point 4).

Each trick hands memlab's own implementation in as the learner's answer in a way the reference watch of
``running.py`` (identity, a trace function, the caller's frame) did not see: a code object cloned into a new
function, a callable object, a worker thread, tracing switched off, a copy of the reference's globals. Each must
earn no points. The course's own solutions (and answers that use memlab's other helpers) keep theirs.

On the code before issue 41.4, the callable objects, the worker threads, tracing switched off, a clone renamed as
the notebook's, the class answer and both rewrites earned full marks (those tests fail there); the plain clones,
the bound method and the plain thread were already caught (by the clone's ``__module__`` or the trace function)
and stay here so that the new looks keep catching them.
"""
from __future__ import annotations

import pytest

from memlab.course.grading import check

SETUP = "import sys, types, functools, threading\nfrom memlab import accounting\nref = accounting.model_state_bytes\n"

TRICKS = {
    "a cloned code object": "model_state_bytes = types.FunctionType(ref.__code__, ref.__globals__, 'model_state_bytes',"
                            " ref.__defaults__, ref.__closure__)",
    "a cloned code object renamed as the notebook's": (
        "model_state_bytes = types.FunctionType(ref.__code__, ref.__globals__, 'model_state_bytes', ref.__defaults__)\n"
        "model_state_bytes.__module__ = '__main__'\nmodel_state_bytes.__qualname__ = 'model_state_bytes'"),
    "a clone with a copy of the globals": "model_state_bytes = types.FunctionType(ref.__code__, dict(ref.__globals__), "
                                          "'model_state_bytes')",
    "a clone made inside the call": "def model_state_bytes(n, r):\n"
                                    "    f = types.FunctionType(accounting.model_state_bytes.__code__, "
                                    "dict(vars(accounting)))\n    return f(n, r)",
    "a clone kept in a global list": "_kept = [types.FunctionType(ref.__code__, dict(ref.__globals__))]\n"
                                     "def model_state_bytes(n, r):\n    return _kept[0](n, r)",
    "a callable object": "class A:\n    __call__ = staticmethod(ref)\nmodel_state_bytes = A()",
    "a callable object with a cloned method": "class A:\n    def __call__(self, n, r):\n        return 0\n"
                                              "A.__call__ = staticmethod(types.FunctionType(ref.__code__, ref.__globals__))\n"
                                              "model_state_bytes = A()",
    "a bound method": "class A:\n    pass\nmodel_state_bytes = types.MethodType(lambda self, n, r: ref(n, r), A())",
    "a worker thread": "from concurrent.futures import ThreadPoolExecutor\n_pool = ThreadPoolExecutor(1)\n"
                       "def model_state_bytes(n, r):\n    return _pool.submit(ref, n, r).result()",
    "a plain thread": "def model_state_bytes(n, r):\n    out = []\n"
                      "    def work():\n        try:\n            out.append((accounting.model_state_bytes(n, r), None))\n"
                      "        except Exception as e:\n            out.append((None, e))\n"
                      "    t = threading.Thread(target=work)\n    t.start(); t.join()\n"
                      "    if out[0][1] is not None:\n        raise out[0][1]\n    return out[0][0]",
    # only the reference made unavailable while the answer runs sees this one: no name of it in the code
    "a name built at run time, in a worker thread, tracing off": (
        "from concurrent.futures import ThreadPoolExecutor\n_pool = ThreadPoolExecutor(1)\n"
        "def model_state_bytes(n, r):\n    sys.settrace(None)\n    f = getattr(accounting, 'model_' + 'state_bytes')\n"
        "    return _pool.submit(f, n, r).result()"),
    "tracing switched off": "def model_state_bytes(n, r):\n    old = sys.gettrace()\n    sys.settrace(None)\n"
                            "    try:\n        return ref(n, r)\n    finally:\n        sys.settrace(old)",
    "tracing switched off for good": "def model_state_bytes(n, r):\n    sys.settrace(None)\n    threading.settrace(None)\n"
                                     "    return ref(n, r)",
}


@pytest.mark.parametrize("trick", list(TRICKS))
def test_memlab_s_reference_passed_off_as_the_answer_earns_no_points(trick):
    ns: dict = {}
    exec(compile(SETUP + TRICKS[trick], "<notebook cell>", "exec"), ns)
    r = check("00.model_state_bytes", ns["model_state_bytes"], quiet=True)
    assert r.points == 0, (trick, str(r))
    assert "reference implementation" in r.message and "model_state_bytes" in r.message, (trick, str(r))


_ZERO = """
import torch
def _zero_code(n):  # a code object that saves nothing, with n free variables (a closure's __code__ takes it)
    names = [f"v{i}" for i in range(n)]
    src = ("def outer():\\n" + "".join(f"    {v} = None\\n" for v in names) + "    def g(t):\\n"
           + (f"        {', '.join(names)}\\n" if names else "") + "        return t.sum() * 0\\n    return g\\n")
    ns = {}
    exec(src, ns)
    return ns["outer"]().__code__
"""


@pytest.mark.parametrize("how", ["what it was given", "the check's module"])
def test_an_answer_that_rewrites_what_the_reference_measures_fails(how):
    """A stub that returns 0 and, before the reference runs, rewrites the measured module's ``forward`` and the
    drawn function's code (or the check's module's name for the reference module), so that the reference measures nothing
    too, must fail: the check runs the reference first, on its own copies; the harness pictures a function
    argument's code, the callables set on a module argument, and the check's and reference's modules."""
    if how == "what it was given":
        body = ("def saved_bytes(f, x):\n    if isinstance(f, torch.nn.Module):\n        for m in f.modules():\n"
                "            m.forward = lambda *a, **k: a[0].sum() * 0\n"
                "    else:\n        f.__code__ = _zero_code(len(f.__code__.co_freevars))\n    return 0\n")
    else:
        body = ("import types\nfrom memlab.course.checks import ch00\n"
                "def saved_bytes(f, x):\n"
                "    ch00.ref = types.SimpleNamespace(saved_activation_bytes=lambda f, x: 0)\n    return 0\n")
    ns: dict = {}
    exec(compile(_ZERO + body, "<notebook cell>", "exec"), ns)
    from memlab.course.checks import ch00

    module = ch00.ref
    try:
        r = check("00.saved_bytes", ns["saved_bytes"], quiet=True)
    finally:
        ch00.ref = module
    assert r.status == "fail" and r.points == 0, str(r)


def test_a_class_answer_that_delegates_to_the_reference_class_with_tracing_off_earns_no_points():
    """A class answer has no call of its own: the reference's methods are swapped for the whole check, and a call
    from the learner's methods counts (the check's own calls of the reference do not)."""
    src = ("import sys\nfrom memlab.course.reference import ch01 as R\n"
           "class LiveBytes:\n"
           "    def __init__(self):\n        sys.settrace(None)\n        self._inner = R.LiveBytes()\n"
           "    def track(self, t):\n        sys.settrace(None)\n        return self._inner.track(t)\n"
           "    def __getattr__(self, k):\n        if k == '_inner':\n            raise AttributeError(k)\n"
           "        return getattr(self._inner, k)\n")
    ns: dict = {}
    exec(compile(src, "<notebook cell>", "exec"), ns)
    r = check("01.live_bytes", ns["LiveBytes"], quiet=True)
    assert r.points == 0 and "reference implementation" in r.message and "LiveBytes" in r.message, str(r)


def test_the_reference_is_restored_and_an_own_answer_keeps_its_points():
    """After grading, memlab's reference runs its own code again (nothing of the stand-in is left), and the
    course's own solutions, which use memlab's other helpers, keep their points."""
    import nbformat
    from pathlib import Path

    from memlab import accounting

    code = accounting.model_state_bytes.__code__
    cell = next(c.source for c in nbformat.read(Path(__file__).resolve().parents[2] / "solutions" /
                                                "00_where_the_memory_goes.ipynb", as_version=4).cells
                if c.cell_type == "code" and "def model_state_bytes(" in c.source)
    ns: dict = {}
    exec(compile(cell, "<notebook cell>", "exec"), ns)
    r = check("00.model_state_bytes", ns["model_state_bytes"], quiet=True)
    assert r.status == "pass" and r.points == 1 and r.message == "", str(r)
    assert accounting.model_state_bytes.__code__ is code and "__memlab_reference_call__" not in vars(accounting)


def test_an_own_class_whose_methods_a_library_decorates_keeps_its_points():
    """Lecture 06's own LoRA layer: its merge and unmerge are ``@torch.no_grad()`` methods, as memlab's are. Every
    function that decorator wraps shares one code object (torch's ``decorate_context``): that code is the library's,
    not the reference's, so an answer that uses the decorator too is judged by what it computes (it read as
    memlab's ``LoRALinear.merge`` and lost its point)."""
    src = ("import math, torch\nfrom torch import nn\n"
           "class LoRALinear(nn.Module):\n"
           "    def __init__(self, base, r=8, alpha=16, scale_by_r=True):\n"
           "        super().__init__()\n        self.base = base.requires_grad_(False)\n"
           "        self.scaling = alpha / r if scale_by_r else alpha\n"
           "        self.lora_A = nn.Linear(base.in_features, r, bias=False)\n"
           "        self.lora_B = nn.Linear(r, base.out_features, bias=False)\n"
           "        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))\n"
           "        nn.init.zeros_(self.lora_B.weight)\n        self.merged = False\n"
           "    def forward(self, x):\n        y = self.base(x)\n"
           "        return y if self.merged else y + self.lora_B(self.lora_A(x)) * self.scaling\n"
           "    @torch.no_grad()\n    def merge(self):\n"
           "        self.base.weight += (self.lora_B.weight @ self.lora_A.weight) * self.scaling\n"
           "        self.merged = True\n"
           "    @torch.no_grad()\n    def unmerge(self):\n"
           "        self.base.weight -= (self.lora_B.weight @ self.lora_A.weight) * self.scaling\n"
           "        self.merged = False\n")
    ns: dict = {}
    exec(compile(src, "<notebook cell>", "exec"), ns)
    r = check("06.lora_linear", ns["LoRALinear"], quiet=True)
    assert r.status == "pass" and r.points == 1, str(r)


_RNG_OWN = ("import torch\nfrom contextlib import contextmanager\n"
            "class RNGSnapshot:\n    def __init__(self):\n        self.state = torch.get_rng_state()\n"
            "    @contextmanager\n    def replay(self):\n        now = torch.get_rng_state()\n"
            "        torch.set_rng_state(self.state)\n        try:\n            yield\n        finally:\n"
            "            torch.set_rng_state(now)\n")


def test_an_own_context_manager_class_keeps_its_points_while_the_reference_is_swapped():
    """02.rng_replay's right answer (the solution's RNGSnapshot): the check runs memlab's RNGState.replay, a
    generator behind @contextmanager, through the grader's stand-in; the stand-in's frame is the grader's, not the
    learner's, so the trace watch does not read the check's own call as the answer's (it did: 0 points)."""
    ns: dict = {}
    exec(compile(_RNG_OWN, "<notebook cell>", "exec"), ns)
    r = check("02.rng_replay", ns["RNGSnapshot"], quiet=True)
    assert r.status == "pass" and r.points == 1, str(r)


def test_a_context_manager_class_that_delegates_to_the_reference_earns_no_points():
    src = ("from memlab.checkpoint.recompute import RNGState\n"
           "class RNGSnapshot:\n    def __init__(self):\n        self._inner = RNGState()\n"
           "    def replay(self):\n        return self._inner.replay()\n")
    ns: dict = {}
    exec(compile(src, "<notebook cell>", "exec"), ns)
    r = check("02.rng_replay", ns["RNGSnapshot"], quiet=True)
    assert r.points == 0 and "reference implementation" in r.message, str(r)
