"""Lecture 04's claims against its own stored outputs and against memlab (issue 36): one thread count for every
timing, the roofline named by the memory level it measured, the two offload techniques named apart with the
planner's meaning, the planner's host bandwidth, the allocator beside the memory figures, cells of ~40 lines."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

LECTURE = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "04_cpu_offload_adam.ipynb"


def _cells():
    return json.loads(LECTURE.read_text(encoding="utf-8"))["cells"]


def _src(cell) -> str:
    return "".join(cell["source"])


def _out(cell) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _code_with(needle: str):
    found = [c for c in _cells() if c["cell_type"] == "code" and needle in _src(c)]
    assert len(found) == 1, f"{len(found)} code cells contain {needle!r}"
    return found[0]


def test_every_timing_runs_at_one_thread_count_and_restores_it():
    """The setup fixes THREADS; the roofline and the kernel read it; the thread comparison puts it back."""
    setup = _code_with("THREADS = torch.get_num_threads()")
    assert "torch.set_num_threads(THREADS)" in _src(setup)
    roofline = _code_with("def bandwidth_now():")
    assert "THREADS" in _src(roofline) and "torch.get_num_threads()" not in _src(roofline)
    compare = _code_with("def at_threads(")
    assert "finally:\n        torch.set_num_threads(THREADS)" in _src(compare)
    # the stored comparison prints the chunked step at 1 thread and at one per core
    assert re.search(r"^1 thread\(s\): chunked eager +[\d.]+ Mparam/s$", _out(compare), re.M), _out(compare)


def test_the_roofline_names_the_level_it_measured():
    """A working set inside the last-level cache is cache bandwidth, one well beyond it DRAM's: the stored line
    must say which, consistently with the sizes it prints."""
    out = _out(_code_with("def bandwidth_now():"))
    m = re.search(r"streaming bandwidth of (memory \(DRAM\)|cache|cache and DRAM \(unknown share\)) \(\d+ thread\(s\), "
                  r"([\d.]+) (MiB|GiB) working set, last-level cache ([\d.]+) MiB\)", out)
    assert m, out
    level, ws, unit, llc = m.group(1), float(m.group(2)), m.group(3), float(m.group(4))
    ws_mib = ws * (1024 if unit == "GiB" else 1)
    if ws_mib <= llc:
        assert level == "cache"
    elif ws_mib > 2 * llc:
        assert level == "memory (DRAM)"
    # and no prose promises the machine's memory bandwidth for a loop whose buffers fit a cache
    assert not any("runs at the machine's memory bandwidth" in _src(c) for c in _cells())


def test_the_planners_offload_adamw_is_the_row_with_offloaded_gradients():
    """Chapter 07's planner runs 'offload-adamw' with offload_gradients=True; lecture 04's row of that name must be
    built from the planner's own mapping, and the gradients-on-device row must not carry the planner's name."""
    from memlab.plan.stack import ESTIMATOR_OPTIMIZER

    assert ESTIMATOR_OPTIMIZER["offload-adamw"][2] == {"offload_gradients": True}
    cell = _code_with('ESTIMATOR_OPTIMIZER["offload-adamw"]')
    src = _src(cell)
    assert '"OffloadedAdamW, grads offloaded": estimate_training_memory(' in src
    assert "optimizer_kwargs=plan_kwargs" in src
    assert "{'offload_gradients': True}: the last row" in _out(cell)
    table = _out(_code_with('print(f"usable on the RTX 4090:'))
    rows = [line for line in table.splitlines() if line.startswith("OffloadedAdamW")]
    assert [r.split("  ")[0] for r in rows] == ["OffloadedAdamW, grads on device", "OffloadedAdamW, grads offloaded"]


def test_host_bandwidth_is_the_planners():
    from memlab.plan.cost import CostModel

    cell = _code_with("t_cpu_7b = 28 * n / host_bw")
    assert "host_bw = CostModel.host" in _src(cell) and "100e9" not in _src(cell)
    assert f"at {CostModel.host / 1e9:.0f} GB/s (this machine's measured bandwidth" in _out(cell)


def test_offloaded_adamw_memory_is_printed_beside_the_allocator():
    out = _out(_code_with("OffloadedAdamW over {n_mb:,} bf16 parameters allocates"))
    m = re.search(r"allocates ([\d,]+) B = ([\d.]+) B/param", out)
    assert m and abs(float(m.group(2)) - 16) < 0.001, out
    steps = [line for line in out.splitlines() if "one step, rise above its start:" in line]
    assert len(steps) == 2 and all("allocator (cpu)" in s and "allocator without the tracker" in s for s in steps)
