"""memlab explain: synthetic CUDA snapshots (each also read by PyTorch's own reader), memlab's timeline pickle against
the tracker it came from, OOM messages, and bad input (one line, a restricted unpickler)."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from memlab.cli import main as memlab_main
from memlab.profiler.explain import SnapshotError, explain, explain_snapshot, parse_oom_message, read_snapshot

MiB = 2**20
A, B = 0x7F0000000000, 0x7F0002000000


def _fr(*frames):
    return [{"filename": f, "line": line, "name": n} for f, line, n in frames]


FWD = _fr(("/site-packages/torch/nn/functional.py", 10, "linear"), ("/site-packages/torch/nn/modules/module.py", 1, "_call_impl"),
          ("/site-packages/transformers/models/llama/modeling_llama.py", 215, "forward"), ("train.py", 40, "main"))
ATTN = _fr(("/site-packages/transformers/models/llama/modeling_llama.py", 300, "forward"),
           ("/site-packages/torch/nn/modules/module.py", 1, "_call_impl"), ("train.py", 40, "main"))
OPT = _fr(("/site-packages/torch/optim/adamw.py", 120, "_init_group"), ("/site-packages/torch/optim/adamw.py", 200, "step"),
          ("train.py", 44, "main"))
BWD = _fr(("/site-packages/torch/autograd/graph.py", 5, "_engine_run_backward"), ("/site-packages/torch/_tensor.py", 6, "backward"),
          ("train.py", 42, "main"))


def _block(addr, size, state, frames=None, requested=None):
    b = {"address": addr, "size": size, "state": state}
    if frames is not None:
        b["frames"] = frames
        b["requested_size"] = size if requested is None else requested
    return b


def _segment(addr, total, blocks):
    alloc = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": 0, "address": addr, "total_size": total, "allocated_size": alloc, "active_size": alloc,
            "requested_size": alloc, "stream": 0, "segment_type": "large", "blocks": blocks}


def _ev(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def snapshot(frames=True, trace=True):
    """Two segments; a 4 MiB activation freed after the peak (its hole is what the OOM could not use)."""
    f = (lambda x: x) if frames else (lambda x: None)
    seg_a = _segment(A, 20 * MiB, [_block(A, 8 * MiB, "active_allocated", f(FWD), 8 * MiB - 100),
                                   _block(A + 8 * MiB, 4 * MiB, "inactive"),
                                   _block(A + 12 * MiB, 6 * MiB, "active_allocated", f(OPT)),
                                   _block(A + 18 * MiB, 2 * MiB, "inactive")])
    seg_b = _segment(B, 2 * MiB, [_block(B, MiB, "active_allocated", f(BWD)), _block(B + MiB, MiB, "inactive")])
    events = [_ev("segment_alloc", A, 20 * MiB), _ev("alloc", A, 8 * MiB, FWD), _ev("alloc", A + 8 * MiB, 4 * MiB, ATTN),
              _ev("alloc", A + 12 * MiB, 6 * MiB, OPT), _ev("segment_alloc", B, 2 * MiB), _ev("alloc", B, MiB, BWD),
              _ev("free_requested", A + 8 * MiB, 4 * MiB, BWD), _ev("free_completed", A + 8 * MiB, 4 * MiB, BWD),
              {**_ev("oom", 0, 5 * MiB), "device_free": MiB}]
    if not frames:
        for e in events:
            e["frames"] = []
    return {"segments": [seg_a, seg_b], "device_traces": [events if trace else []]}


def _dump(tmp_path, name, obj):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(obj))
    return p


def _torch_reads(path):
    r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_snapshot_at_its_peak(tmp_path):
    p = _dump(tmp_path, "snap.pickle", snapshot())
    assert "total_reserved: 22.0MiB" in _torch_reads(p)  # PyTorch's own reader takes the fixture
    e = explain(p)
    assert e.kind == "CUDA memory snapshot" and "after event 6 of 9" in e.when
    assert e.allocated_bytes == 19 * MiB and e.reserved_bytes == 22 * MiB  # the freed activation is live at the peak
    assert e.by_category == {"activations (forward)": 12 * MiB, "optimizer": 6 * MiB,
                             "backward (gradients, activation gradients)": MiB}
    assert e.by_source["modeling_llama.py forward"] == 12 * MiB and e.by_source["adamw.py _init_group"] == 6 * MiB
    assert [b.size for b in e.largest] == [8 * MiB, 6 * MiB, 4 * MiB, MiB]
    assert e.largest[0].where == "modeling_llama.py:215 forward" and e.largest[0].requested == 8 * MiB - 100
    assert e.largest[2].where == "modeling_llama.py:300 forward"  # where it was made, not where it was freed
    # fragmentation as the snapshot was taken: 6 MiB free in A (largest 4), 1 MiB in B
    assert e.free_in_segments_bytes == 7 * MiB and e.largest_free_block_bytes == 4 * MiB
    assert e.segments[0] == (A, 20 * MiB, 6 * MiB, 4 * MiB)
    assert e.request_bytes == 5 * MiB and e.expandable_segments.startswith("would likely help")
    text = e.text()
    assert "failed request: 5.00 MiB" in text and "the 4 largest live blocks" in text


def test_without_frames_or_trace(tmp_path):
    for name, obj in (("bare.pickle", snapshot(frames=False, trace=False)),
                      ("list.pickle", snapshot(frames=False, trace=False)["segments"]),
                      ("noframes.pickle", snapshot(frames=False))):
        p = _dump(tmp_path, name, obj)
        _torch_reads(p)
        e = explain(p)
        if name != "noframes.pickle":
            assert e.allocated_bytes == 15 * MiB and "no allocator trace" in e.when
        else:
            assert e.allocated_bytes == 19 * MiB
        assert set(e.by_category) == {"unknown (no frames)"} and any("no stack frames" in n for n in e.notes)


def test_expandable_verdicts():
    snap = snapshot()
    snap["device_traces"][0][-1]["size"] = 3 * MiB  # a free 4 MiB block could hold it: not fragmentation
    assert explain_snapshot(snap).expandable_segments.startswith("would not help: a free cached block")
    snap["device_traces"][0][-1]["size"] = 40 * MiB  # more than all cached and free memory: real demand
    assert "short of the request" in explain_snapshot(snap).expandable_segments


def test_timeline_pickle_gives_the_trackers_breakdown(tmp_path):
    from memlab.profiler.timeline import Timeline

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    for _ in range(2):  # the second step: optimizer state exists before it
        with Timeline(model, opt) as tl:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    p = tl.save_snapshot(tmp_path / "tl.pickle")
    _torch_reads(p)
    e = explain(p)
    bd = tl.tracker.breakdown("peak")
    assert e.kind == "memlab timeline" and e.allocated_bytes == tl.tracker.peak_bytes == e.reserved_bytes
    assert e.by_category == {k: v for k, v in bd.items() if v}  # every category, activations and other included


def test_oom_messages(tmp_path):
    new = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in "
           "use. Of the allocated memory 73.50 GiB is allocated by PyTorch, and 4.10 GiB is reserved by PyTorch but "
           "unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    f = parse_oom_message(new)
    G = 2**30
    assert f == {"request": 2 * G, "capacity": round(79.19 * G), "free": round(1.06 * G),
                 "allocated": round(73.5 * G), "reserved_unallocated": round(4.1 * G)}
    p = tmp_path / "oom.txt"
    p.write_text(new)
    e = explain(p)
    assert e.kind == "oom message" and e.reserved_bytes == round(73.5 * G) + round(4.1 * G)
    assert e.expandable_segments.startswith("would likely help")
    old = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
           "14.56 GiB already allocated; 3.12 MiB free; 14.74 GiB reserved in total by PyTorch)")
    f = parse_oom_message(old)
    assert f["request"] == 20 * MiB and f["allocated"] == round(14.56 * G) and f["free"] == round(3.12 * MiB)
    assert f["reserved_unallocated"] == round(14.74 * G) - round(14.56 * G)
    p.write_text(old)
    assert "would likely help" in explain(p).expandable_segments  # 184 MiB cached, 20 MiB asked
    p.write_text(old.replace("14.74 GiB reserved", "14.56 GiB reserved"))
    assert "short of the request" in explain(p).expandable_segments


class _Flag:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').close()",))


def test_bad_input_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = pickle.dumps(snapshot())
    cases = {"trunc.pickle": (good[: len(good) // 2], "truncated"),
             "evil.pickle": (pickle.dumps({"segments": [_Flag()]}), "refused to load builtins.exec"),
             "dict.pickle": (pickle.dumps({"traces": []}), "without 'segments'"),
             "ints.pickle": (pickle.dumps([1, 2]), "a segment without"),
             "notes.txt": (b"hello", "no 'Tried to allocate"),
             "blob.bin": (b"\xff\xfe\x00\x01", "neither a pickle nor text")}
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SnapshotError) as err:
            explain(tmp_path / name)
        msg = str(err.value)
        assert msg.startswith(f"{tmp_path / name}: ") and why in msg and "\n" not in msg, msg
        assert "a CUDA memory snapshot" in msg
    assert not (tmp_path / "PWNED").exists()  # the restricted unpickler ran nothing
    with pytest.raises(SnapshotError, match="truncated"):
        read_snapshot(tmp_path / "trunc.pickle")
    with pytest.raises(FileNotFoundError, match="no such file"):
        explain(tmp_path / "missing.pickle")


def test_command_line(tmp_path, capsys):
    p = _dump(tmp_path, "snap.pickle", snapshot())
    assert memlab_main(["explain", str(p)]) == 0
    out = capsys.readouterr().out
    assert "allocated 19.00 MiB, reserved 22.00 MiB" in out and "expandable_segments: would likely help" in out
    assert memlab_main(["explain", "--json", str(p)]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["allocated_bytes"] == 19 * MiB
    (tmp_path / "bad.pickle").write_bytes(b"\x80\x04\x95")
    assert memlab_main(["explain", str(tmp_path / "bad.pickle")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memlab explain: error: ") and "bad.pickle" in err


def test_command_line_ranks_the_fixes_with_a_model(tmp_path, capsys):
    pytest.importorskip("transformers")
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                                   max_position_embeddings=512)))
    msg = tmp_path / "oom.txt"  # a 1 GiB card (339 MiB usable): a 32k vocabulary's logits at 4 x 512 do not fit
    msg.write_text("CUDA out of memory. Tried to allocate 250.00 MiB. GPU 0 has a total capacity of 1.00 GiB of which "
                   "0 bytes is free. Of the allocated memory 300.00 MiB is allocated by PyTorch, and 2.00 MiB is "
                   "reserved by PyTorch but unallocated.")
    argv = ["explain", str(msg), "--model", str(cfg), "--batch-size", "4", "--seq-len", "512", "--no-extrapolate"]
    assert memlab_main(argv) == 0
    out = capsys.readouterr().out
    assert f"--gpu {2**30}B" in out and "verdict: DOES NOT FIT" in out and "to reproduce a traced row:" in out
    table = out.split("what would make it fit")[1].split("\n\n")[0]
    rows = [ln for ln in table.splitlines() if ln.endswith((" yes", " no")) and "technique" not in ln]
    import re

    from memlab.core.units import parse_size

    assert any("gradient checkpointing" in ln for ln in rows) and len(rows) >= 3
    peaks = [parse_size(re.search(r"([\d,]+(?:\.\d+)? (?:B|KiB|MiB|GiB))", ln).group(1).replace(" ", "").replace(",", "")) for ln in rows]
    assert peaks == sorted(peaks)  # ranked by the traced peak
    with pytest.raises(SystemExit):
        memlab_main(["explain", str(msg), "--batch-size", "4"])  # estimate's flags without --model
    assert "need --model" in capsys.readouterr().err


def _timeline_step():
    from memlab.profiler.timeline import Timeline

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 2000), torch.nn.ReLU(), torch.nn.Linear(2000, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 64)
    for _ in range(2):  # the second step: optimizer state exists before it
        with Timeline(model, opt) as tl:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return tl


def test_a_timeline_gets_the_caching_allocator_models_prediction(tmp_path, capsys):
    import functools

    from memlab.estimate.allocator_replay import replay

    tl = _timeline_step()
    p = tl.save_snapshot(tmp_path / "tl.pickle")
    # the timeline's allocations in time order, built from its bands (not from the pickle): the storages alive
    # before the step first, then each op's frees before its allocations
    allocs = tl.allocations
    before = [("alloc", i, a.nbytes) for i, a in enumerate(allocs) if a.start == 0 and a.op == "(before)"]
    timed = sorted([(a.start, 1, i) for i, a in enumerate(allocs) if not (a.start == 0 and a.op == "(before)")]
                   + [(a.end, 0, i) for i, a in enumerate(allocs) if a.end is not None])
    events = before + [("alloc", i, allocs[i].nbytes) if k else ("free", i) for _, k, i in timed]
    for conf in (None, "expandable_segments:True"):
        want = replay(events, conf)
        e = explain(p, allocator=functools.partial(replay, config=conf))
        assert e.kind == "memlab timeline" and e.allocated_bytes == tl.tracker.peak_bytes == e.reserved_bytes
        assert (e.predicted_reserved_bytes, e.predicted_allocated_bytes, e.predicted_max_reserved_bytes) == (
            want.reserved_at_peak, want.allocated_at_peak, want.max_reserved)
        assert e.predicted_reserved_bytes > e.predicted_allocated_bytes >= e.allocated_bytes  # blocks of 512 bytes
        assert e.predicted_by.endswith(want.config.describe())
    text = e.text()
    assert "caching-allocator model (memlab.estimate.caching_allocator, PYTORCH_CUDA_ALLOC_CONF=" in text
    assert "the model's prediction for a CUDA card, not a measurement" in text
    assert not explain(p).predicted_by  # no allocator given: the timeline alone, as before
    # a real CUDA snapshot keeps its measured segments: the model is not used
    real = explain(_dump(tmp_path, "snap.pickle", snapshot()), allocator=replay)
    assert not real.predicted_by and real.reserved_bytes == 22 * MiB and real.segments
    # the command passes the model (and its settings)
    assert memlab_main(["explain", str(p)]) == 0
    out = capsys.readouterr().out
    assert "caching-allocator model (memlab.estimate.caching_allocator, PyTorch's default allocator settings)" in out
    assert memlab_main(["explain", str(p), "--alloc-conf", "expandable_segments:True"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in capsys.readouterr().out
    assert memlab_main(["explain", str(p), "--alloc-conf", "garbage:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memlab explain: error: --alloc-conf: ")
    assert memlab_main(["explain", str(_dump(tmp_path, "snap.pickle", snapshot()))]) == 0
    assert "caching-allocator model" not in capsys.readouterr().out


def test_explain_sizes_requests_by_the_allocator_configs_rounding():
    # memlab explain and the caching-allocator model round a request by one rule (memlab.core.allocator_config):
    # a snapshot's roundup_power2_divisions (every interval listed, as PyTorch writes it) gives the same sizes
    from memlab.core.allocator_config import AllocatorConfig, round_size
    from memlab.profiler.snapshot_replay import Sizer

    listed = {str(1 << i): (4 if i >= 1 else 0) for i in range(16)}
    sizer = Sizer({"roundup_power2_divisions": listed})
    cfg = AllocatorConfig(roundup_power2_divisions={int(k): v for k, v in listed.items()})
    for n in (1, 511, 513, 3 << 20, (5 << 20) + 1, 700 << 20, (1 << 30) + 12345):
        assert sizer.rounded(n) == round_size(n, cfg)
    assert sizer.rounded((5 << 20) + 1) == 6 << 20  # 4 steps between 4 and 8 MiB
    assert Sizer({}).rounded((5 << 20) + 1) == (5 << 20) + 512
    assert Sizer({"roundup_power2_divisions": {"1": 3}}).rounded(1000) == 1024  # refused by the config: plain
