"""Lecture 02's on-page code and claims (issue 36): the offload hook copies on a side stream, the
lecture's own peak prediction passes the lab's check, timings are measured where compute dominates,
memory numbers sit beside the allocator's, and no code cell is a wall of code."""
from __future__ import annotations

import ast
import json
import math
import pathlib

import pytest
import torch
from torch import nn

LECTURE_02 = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "02_gradient_checkpointing.ipynb"


def _cells(kind="code"):
    return ["".join(c["source"]) for c in json.loads(LECTURE_02.read_text())["cells"] if c["cell_type"] == kind]


def _cell_defining(name):
    found = [s for s in _cells() if any(isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name
                                        for n in ast.parse(s).body)]
    assert len(found) == 1, f"{len(found)} code cells of lecture 02 define {name}"
    return found[0]


def _definition(name, namespace):
    """Run only the definition of `name` from its cell (not the cell's experiments) in `namespace`."""
    tree = ast.parse(_cell_defining(name))
    node = next(n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"lecture02:{name}", "exec"), namespace)
    return namespace[name]


def _calls(node):
    return {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
            for n in ast.walk(node) if isinstance(n, ast.Call)}


def test_myoffload_issues_its_device_to_host_copy_on_a_side_stream():
    """The prose says pinned copies overlap the compute; that needs the copy on a stream of its own, after
    the compute stream (wait_stream), the tensor marked as used there (record_stream) and an event the
    compute stream waits for before copying back. The old cell copied on the compute stream."""
    cls = next(n for n in ast.parse(_cell_defining("MyOffload")).body if isinstance(n, ast.ClassDef))
    assert "Stream" in _calls(cls), "MyOffload makes no torch.cuda.Stream"
    side_blocks = [w for w in ast.walk(cls) if isinstance(w, ast.With)
                   and any(isinstance(i.context_expr, ast.Call) and isinstance(i.context_expr.func, ast.Attribute)
                           and i.context_expr.func.attr == "stream" for i in w.items)]
    assert side_blocks, "no `with torch.cuda.stream(...)` block in MyOffload"
    copies = [c for w in side_blocks for c in ast.walk(w) if isinstance(c, ast.Call)
              and isinstance(c.func, ast.Attribute) and c.func.attr == "copy_"
              and any(k.arg == "non_blocking" and getattr(k.value, "value", None) is True for k in c.keywords)]
    assert copies, "the device-to-host copy_(..., non_blocking=True) is not inside the side stream's block"
    assert {"wait_stream", "record_stream", "wait_event", "record"} <= _calls(cls)


def test_myoffload_still_moves_the_activations_and_keeps_the_gradients_on_cpu():
    MyOffload = _definition("MyOffload", {"torch": torch, "nn": nn})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    net(x).square().sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    ctx = MyOffload([*net.parameters()], include_cpu=True)
    with ctx:
        out = net(x)
    out.square().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), ref))
    assert ctx.moved["to host"] == ctx.moved["back"] > 0 and ctx.moved["kept in place"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_myoffload_on_cuda_frees_the_device_and_gives_the_same_gradients():
    MyOffload = _definition("MyOffload", {"torch": torch, "nn": nn})
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)]).cuda()
    x = torch.randn(64, 256, device="cuda")
    net(x).square().sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    plain = net(x)
    held_plain = torch.cuda.memory_allocated() - before
    del plain
    with MyOffload([*net.parameters()]) as ctx:
        out = net(x)
    torch.cuda.synchronize()
    held_off = torch.cuda.memory_allocated() - before
    out.square().sum().backward()
    torch.cuda.synchronize()
    assert held_off < 0.2 * held_plain
    assert all(torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6) for p, g in zip(net.parameters(), ref))
    assert ctx.moved["to host"] == ctx.moved["back"] > 0


def test_the_lectures_own_peak_prediction_passes_the_labs_check():
    """The lecture teaches the backward transients and builds the prediction lab exercise 6 grades to
    1.5%: the on-page function passes the lab's check (the old page had no such function, and its
    segment model was 7.7% off)."""
    from memlab.accounting import activation_bytes_per_layer
    from memlab.course.grading import check

    fn = _definition("my_predict_ckpt_peak", {"math": math, "activation_bytes_per_layer": activation_bytes_per_layer})
    assert check("02.predict_ckpt_peak", fn).status == "pass"


def test_timings_are_also_measured_where_the_arithmetic_dominates():
    """The old section 5 presented small-scale CPU timings, mostly fixed cost, as recomputation's cost. The
    lecture now times a compute-bound size beside a fixed-cost size and asserts the fixed cost is small there."""
    src = _cell_defining("step_times")
    assert "compute-bound" in src and "fixed" in src
    assert any("not the cost of recomputation" in s for s in _cells("markdown"))


def test_memory_numbers_are_printed_beside_the_allocators():
    code = "\n".join(_cells())
    assert code.count("peak_beside_allocator(") + code.count("rise_beside_allocator(") >= 4
    assert "allocator_peak(" in code
    assert any("torch.get_rng_state()" in s for s in _cells("markdown")), "the RNG snapshot the tracker misses is not named"


@pytest.mark.parametrize("name", ["00_where_the_memory_goes", "02_gradient_checkpointing", "03_mixed_precision"])
def test_no_code_cell_is_a_wall_of_code(name):
    nb = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / f"{name}.ipynb"
    long = [(i, n) for i, c in enumerate(json.loads(nb.read_text())["cells"]) if c["cell_type"] == "code"
            and (n := sum(1 for ln in "".join(c["source"]).splitlines() if ln.strip())) > 45]
    assert not long, f"{name}: code cells over 45 non-blank lines (cell, lines): {long}"
