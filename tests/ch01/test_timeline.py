"""memlab.profiler.timeline: every storage of a step as a band in time, its sum equal to MemoryTracker's
count op for op; exported as PyTorch's memory snapshot (memory_viz) and as a self-contained
interactive page, which a real browser renders (headless Chromium, when installed)."""
from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memlab.models import TinyGPT, TinyGPTConfig
from memlab.profiler.timeline import Timeline

ROOT = Path(__file__).resolve().parents[2]
CFG = TinyGPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32)


def _run(fake: bool = False) -> Timeline:
    torch.manual_seed(0)
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        with mode:
            model = TinyGPT(CFG)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randint(0, CFG.vocab_size, (2, 32))
    else:
        model = TinyGPT(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, CFG.vocab_size, (2, 32))
    tl = Timeline(model, opt)
    ctx = mode if fake else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx, tl:
        for _ in range(2):
            loss = model(x, x)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
    return tl


@pytest.fixture(scope="module")
def tl():
    return _run()


def test_bands_sum_to_the_trackers_count_after_every_op(tl):
    live = tl.live_bytes()
    events = tl.tracker.timeline
    assert len(events) > 100
    seen = set()
    for e in events:  # the tracker records a total after op number e.index whenever it changed
        if e.index in seen:  # a second record at the same index: its optimizer hook, between two ops
            continue
        seen.add(e.index)
        assert live[e.index] == e.total, (e.index, live[e.index], e.total)
    assert tl.peak_bytes == tl.tracker.peak_bytes


def test_categories_and_ops(tl):
    n_params = sum(1 for _ in tl.model.parameters())
    n_buffers = sum(1 for _ in tl.model.buffers())  # counted with the parameters, as MemoryTracker does
    params = [a for a in tl.allocations if a.category == "parameters"]
    assert len(params) == n_params + n_buffers and all(a.start == 0 and a.end is None for a in params)
    grads = [a for a in tl.allocations if a.category == "gradients"]
    assert len(grads) >= 2 * n_params and all(a.phase == "backward" for a in grads)  # two steps, freed by zero_grad
    assert all(a.end is not None for a in grads)  # zero_grad(set_to_none=True) freed them
    state = [a for a in tl.allocations if a.category == "optimizer" and a.end is None]
    assert sum(a.nbytes for a in state) == 2 * sum(p.numel() * 4 for p in tl.model.parameters()) + 4 * n_params
    acts = [a for a in tl.allocations if a.category == "activations"]
    assert {"mm", "addmm"} & {a.op for a in acts} and all(a.end is not None for a in acts)


def test_fake_tensors_give_the_same_timeline_as_real_ones(tl):
    fake = _run(fake=True)
    assert fake.peak_bytes == fake.tracker.peak_bytes == tl.peak_bytes
    assert [(a.nbytes, a.category, a.op) for a in fake.allocations] == [(a.nbytes, a.category, a.op) for a in tl.allocations]


def test_snapshot_is_what_torch_memory_viz_reads(tl, tmp_path):
    from torch.cuda import _memory_viz

    path = tl.save_snapshot(tmp_path / "step.pickle")
    snap = pickle.loads(path.read_bytes())
    assert set(snap) == {"segments", "device_traces"}
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]  # a relabelled storage is freed and re-allocated at its address
    frees = [e for e in trace if e["action"] == "free_completed"]
    assert len(frees) == len([e for e in trace if e["action"] == "free_requested"])
    # the bytes alive at the end of the trace are the active blocks of the final segment
    alive_end = sum(a.nbytes for a in tl.allocations if a.end is None)
    seg = snap["segments"][0]
    assert sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated") == alive_end
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    # replayed the way memory_viz does (allocs minus frees, pre-existing blocks inferred), the peak is the tracker's
    pre = sum(a.nbytes for a in tl.allocations if a.start == 0)
    live = peak = pre
    for e in trace:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        peak = max(peak, live)
    assert live == alive_end
    assert allocs and all(e["frames"][0]["filename"].startswith("category: ") for e in allocs)
    # torch's own readers of the format accept it: trace() names every event, each alloc in its segment
    text = _memory_viz.trace(snap)
    assert f"{len(trace)} entries" in text
    assert len(re.findall(r"^\w+ = (?:seg_0|MEM)\[", text, re.M)) == len(allocs)
    assert text.count("# free completed for ") == len(frees)
    assert "segments: 1" in _memory_viz.segsum(snap)


def test_html_is_self_contained(tl):
    page = tl.html(full_page=True)
    assert "<script src" not in page and "cdn" not in page.lower() and "http" not in page.replace("http-equiv", "")
    assert page.count("<canvas") == 1 and '"peak":%d' % tl.peak_bytes in page
    with pytest.raises(ValueError, match=r"max_bands=0 is invalid; allowed: an int >= 1"):
        tl.html(max_bands=0)
    small = tl.html(max_bands=5)
    assert f'"hidden":{len(tl.allocations) - 5}' in small


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        Timeline("not a model")


def _browser():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import timeline_screenshot
    finally:
        sys.path.pop(0)
    return timeline_screenshot


def test_a_real_browser_renders_the_page_and_its_hover(tmp_path):
    shot = _browser()
    browser = shot.find_browser()
    if browser is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium): tools/timeline_screenshot.py cannot run")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "utils"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "timeline_screenshot.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the tooltip the page's script wrote: the tensor, its bytes, its category and phase
    assert re.search(r"hover: \S+ -> \[[\d, ]+\] \w+ [\d.]+ \w?i?B · activations · made in (forward|backward) "
                     r"alive from op \d+ to op \d+", proc.stdout), proc.stdout


def test_a_view_of_a_tensor_made_before_recording_gets_no_band():
    old = torch.zeros(256, 1024)  # 1 MiB, made before: the allocator allocates nothing for its views
    with Timeline() as tl:
        v = old[1:].t().unsqueeze(0)[..., :10].expand(3, -1, -1)
        w = old.sum(0)  # a reduction: its output only
    assert [a.op for a in tl.allocations] == ["sum"] and tl.peak_bytes == w.untyped_storage().nbytes()
    assert tl.peak_bytes == tl.tracker.peak_bytes and v.shape == (3, 1024, 10)


def test_jupyterlab_renders_the_timeline_as_a_notebook_output(tmp_path):
    """tools/timeline_screenshot.py --jupyterlab: a real JupyterLab server, the executed and trusted
    notebook opened in Chromium, the output's script run by JupyterLab (legend and hover drawn), a
    screenshot; the server and its kernel are gone afterwards (about 15 s on 2 cores)."""
    import importlib.util

    shot = _browser()
    if shot.find_browser() is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium): the JupyterLab screenshot cannot run")
    missing = [m for m in ("jupyterlab", "nbclient", "tornado") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: the JupyterLab screenshot cannot run")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "utils"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "timeline_screenshot.py"), "--jupyterlab",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    png = (tmp_path / "timeline_jupyterlab.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 1000)
    assert "legend: parameters, gradients, optimizer, activations, other;" in proc.stdout, proc.stdout
    assert re.search(r"hover: \S+ -> \[[\d, ]+\] \w+ [\d.]+ \w?i?B · activations · made in (forward|backward) "
                     r"alive from op \d+ to op \d+", proc.stdout), proc.stdout
    root = re.search(r"JupyterLab server \(pid (\d+), root (\S+)\) stopped", proc.stdout)
    assert root, proc.stdout
    with pytest.raises(ProcessLookupError):
        os.kill(int(root.group(1)), 0)
    leftover = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert root.group(2) not in leftover  # neither the server nor its kernel (its connection file is in there)
    assert not Path(root.group(2)).exists()


class _Scratchy(torch.optim.SGD):
    """SGD whose step keeps a buffer outside ``state``: the tracker counts it as optimizer during the step and as
    other after it."""

    def step(self, closure=None):
        out = super().step(closure)
        self.scratch = torch.zeros(3000)
        return out


def _by_category(tl: Timeline, i: int) -> dict[str, int]:
    from memlab.profiler.storage import CATEGORIES

    out = dict.fromkeys(CATEGORIES, 0)
    for a in tl.allocations:
        if a.start <= i and (a.end is None or a.end > i):
            out[a.category] += a.nbytes
    return out


def test_every_band_has_the_trackers_category_after_every_op(tl):
    """The loss made outside the model (here ``pow`` and ``mean`` on its output, and the backward's seed
    ``ones_like``) is an activation for the tracker (its forward phase lasts until the backward): the bands say so
    too; a buffer an optimizer step keeps outside its state turns from optimizer to other after the step, as the
    tracker relabels it. Checked after every op, for that step and for the TinyGPT fixture."""
    from memlab.profiler.explain import explain_snapshot

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Linear(512, 16))
    opt = _Scratchy(model.parameters(), lr=0.1)
    x = torch.randn(256, 16)
    with Timeline(model, opt) as own:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for t in (own, tl):
        seen = set()
        for e in t.tracker.timeline:
            if e.index not in seen:  # a second record at one index: a hook between two ops (the next op shows it)
                seen.add(e.index)
                assert _by_category(t, e.index) == e.bytes, (e.index, e.phase)
    assert own.tracker.breakdown("end")["other"] == 3000 * 4 and own.tracker.peak_phase == "backward"
    assert _by_category(own, own.ops)["other"] == 3000 * 4
    peak = {k: v for k, v in own.tracker.breakdown("peak").items() if v}
    assert explain_snapshot(own.snapshot()).by_category == peak and peak["activations"] > 0
