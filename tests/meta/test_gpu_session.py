"""The GPU lease's plan (tools/gpu_session.py), its packer, its wheel check and the import tool: planning only,
no notebook is run."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gs = _load("gpu_session")
gi = _load("gpu_import")


def _steps(stages):
    return [s for st in stages for s in st.steps]


def test_call_one_measures_the_targets_and_call_two_runs_every_lecture_once():
    one = [s.name for s in _steps(gs.plan(1))]
    two = [s.name for s in _steps(gs.plan(2))]
    lectures = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(lectures) >= 10
    assert one[0] == two[0] == "env"
    assert not [n for n in one if n.startswith("lecture_")]
    assert one.index("cuda_tests") < one.index("bench_qlora")
    for name in ("snapshots", "estimator_cuda", "bench_attention", "bench_loss", "bench_offload"):
        assert name in one
    assert sorted(n[len("lecture_"):] for n in two[1:]) == lectures and len(two) == len(lectures) + 1


def test_budgets_fit_each_call_and_cover_the_projection():
    assert gs.CALL_LIMIT_S == {1: 540, 2: 540}
    assert gs.total(gs.plan(1)) <= gs.CALL_LIMIT_S[1], gs.format_plan(gs.plan(1), 1)
    for call in (1, 2):
        for s in _steps(gs.plan(call)):
            assert 0 < s.projected_s <= s.budget_s, s.name
            assert s.budget_s + 60 <= gs.CALL_LIMIT_S[call], s.name  # each fits a call after the env step
    # the lectures' budgets come from the H200 measurements, with a margin
    for s in _steps(gs.plan(2))[1:]:
        assert s.budget_s == round(gs.LECTURE_GPU_S[s.name[8:10]] * gs.LECTURE_MARGIN), s.name


def test_timings_never_share_the_gpu():
    for call in (1, 2):
        for st in gs.plan(call):
            if len(st.steps) > 1:
                assert all(s.concurrent for s in st.steps), st.name
            for s in st.steps:
                if s.name.startswith("lecture_") and s.name[8:10] in gs.TIMED_LECTURES:
                    assert len(st.steps) == 1, s.name


def _lecture_tree(root: Path, on_gpu: set[str]) -> Path:
    (root / "notebooks").mkdir(parents=True)
    for stem in ("00_a", "01_b", "05_c", "07_d"):
        line = ("device cuda:0 (NVIDIA H200, 139.8 GiB, compute 9.0); torch 2.11" if stem in on_gpu
                else "device cpu (2 cores); torch 2.13.0+cpu")
        nb = {"cells": [{"cell_type": "markdown", "source": "NVIDIA H100 in the prose names no device"},
                        {"cell_type": "code", "outputs": [{"output_type": "stream", "text": [line + "\n", "more\n"]}]}]}
        (root / "notebooks" / f"{stem}.ipynb").write_text(json.dumps(nb))
    return root


def test_lectures_whose_outputs_name_no_gpu_go_first(tmp_path):
    root = _lecture_tree(tmp_path, on_gpu={"01_b", "05_c"})
    assert [gs.stored_on_gpu(p) for p in gs.lectures(root)] == [False, True, True, False]
    names = [[s.name for s in st.steps] for st in gs.lecture_stages(root)]
    # not yet from a GPU: 00 (memory only, a stage of its own kind) then 07 (timed, alone); then the rest
    assert names == [["lecture_00_a"], ["lecture_07_d"], ["lecture_05_c"], ["lecture_01_b"]]


def test_a_lecture_starts_only_with_its_whole_budget_left():
    lec = gs.Step("lecture_07_x", ["true"], 300, 200, "")
    other = gs.Step("bench_loss", ["true"], 80, 60, "")
    assert gs.fits(lec, 300, 300) and not gs.fits(lec, 300, 299)
    assert gs.fits(other, 80, 5) and not gs.fits(other, 80, 4.9)


def test_side_by_side_steps_get_a_share_of_the_cores():
    base = {"PATH": "/bin"}
    assert gs.step_env(base, None) is base
    assert gs.step_env(base, 4) == {"PATH": "/bin", "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}


def test_limit_is_checked(capsys):
    for bad in ("0", "601", "-5"):
        with pytest.raises(SystemExit):
            gs.main(["--limit", bad, "--call", "2"])
        assert f"--limit {float(bad)}" in capsys.readouterr().err


def test_plan_only_prints_the_projection_and_runs_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_SESSION_WORK", str(tmp_path / "work"))
    assert gs.main(["--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "bench_offload" in out and "lecture_" not in out
    assert f"projected GPU time {gs.total(gs.plan(1), 'projected_s'):.0f} s" in out
    assert gs.main(["--plan-only", "--call", "2"]) == 0
    assert "lecture_00_where_the_memory_goes" in capsys.readouterr().out
    assert not (tmp_path / "work").exists()


def _synthetic_work(root: Path, sizes: dict[str, int]) -> Path:
    work = root / "work"
    for name, size in sizes.items():
        p = work / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))  # incompressible: the chunks' sizes are the files' sizes
    return work


def _unpack(out: Path) -> dict[str, bytes]:
    blob = b"".join(f.read_bytes() for f in sorted(out.glob("results.tgz.*")))
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_pack_splits_into_chunks_within_the_limits_and_round_trips(tmp_path):
    kib = 1024
    work = _synthetic_work(tmp_path, {"summary.json": 100, "logs/a.log": 30 * kib, "notebooks/00_x.ipynb": 50 * kib})
    res = gs.pack(work, tmp_path / "out", max_files=8, max_bytes=32 * kib)
    files = sorted((tmp_path / "out").iterdir())
    assert [f.name for f in files] == res["chunks"] and 3 <= len(files) <= 8
    assert all(f.stat().st_size <= 32 * kib for f in files)
    got = _unpack(tmp_path / "out")
    assert got["notebooks/00_x.ipynb"] == (work / "notebooks/00_x.ipynb").read_bytes()
    assert res["dropped"] == []


def test_pack_drops_the_lowest_value_files_when_over_the_file_count(tmp_path):
    kib = 1024
    work = _synthetic_work(tmp_path, {"summary.json": 200, "logs/cuda_tests.log": 20 * kib,
                                      "notebooks/00_x.ipynb": 40 * kib, "snapshots/big.pickle": 90 * kib})
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.tgz.07").write_bytes(b"stale")  # from an earlier, larger pack: must go
    res = gs.pack(work, out, max_files=2, max_bytes=32 * kib)
    assert len(res["chunks"]) <= 2 and all((out / c).stat().st_size <= 32 * kib for c in res["chunks"])
    assert sorted(f.name for f in out.iterdir()) == res["chunks"]
    assert res["dropped"] == ["snapshots/big.pickle"]
    got = _unpack(out)
    assert {"summary.json", "logs/cuda_tests.log", "notebooks/00_x.ipynb"} <= set(got)
    assert got["dropped.txt"].decode().split() == ["snapshots/big.pickle"]


def _wheels(d: Path, names: list[str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"")
    return d


ALL = ["bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", "nbclient-0.11.0-py3-none-any.whl",
       "nbformat-5.11.1-py3-none-any.whl", "ipykernel-7.4.0-py3-none-any.whl",
       "jupyter_client-8.10.0-py3-none-any.whl", "nbval-0.11.0-py2.py3-none-any.whl"]


def test_check_wheels_names_exactly_the_missing_ones(tmp_path):
    assert gs.check_wheels(_wheels(tmp_path / "all", ALL)) == []
    assert gs.check_wheels(_wheels(tmp_path / "some", ALL[1:4])) == ["bitsandbytes", "jupyter_client", "nbval"]
    assert gs.check_wheels(tmp_path / "absent") == list(gs.REQUIRED)
    line = gs.missing_wheel_line(["bitsandbytes"], tmp_path)
    assert "bitsandbytes" in line and "fetch_wheels" in line and line.count("\n") == 0
    with pytest.raises(SystemExit, match="two versions"):
        gs.check_wheels(_wheels(tmp_path / "dup", ALL + ["nbval-0.10.0-py2.py3-none-any.whl"]))
    with pytest.raises(ValueError, match="not-a-wheel.zip"):
        gs.wheel_dist("not-a-wheel.zip")


def test_a_missing_wheel_fails_the_session_at_once_with_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GPU_SESSION_REHEARSE", raising=False)
    t0 = time.monotonic()
    rc = gs.env_step(tmp_path, online=False, whl=_wheels(tmp_path / "whl", ALL[1:]))
    assert rc == 3 and time.monotonic() - t0 < gs.INSTALL_DEADLINE_S
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [gs.missing_wheel_line(["bitsandbytes"], tmp_path / "whl")]


def test_gpu_import_places_each_kind_of_result(tmp_path):
    work = tmp_path / "work"
    files = {
        "summary.json": json.dumps({"started": "2026-12-01T08:00:00Z", "steps": [
            {"step": "lecture_00_x", "status": "ok"}, {"step": "lecture_01_y", "status": "timed out at 68 s"}]}),
        "logs/env.log": "|   0  NVIDIA H100 80GB HBM3          On  |",
        "logs/cuda_tests.log": "20 passed",
        "logs/kernel_01_y.pid": "123",
        "notebooks/00_x.ipynb": "{}", "notebooks/01_y.ipynb": "{}",
        "snapshots/tinygpt_ch00.pickle": "snap",
    }
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    gs.pack(work, tmp_path / "out", max_bytes=200)  # several chunks: the import joins them
    assert len(list((tmp_path / "out").iterdir())) > 1
    root = tmp_path / "repo"
    moves = dict(gi.import_results([tmp_path / "out"], root=root))
    assert moves["notebooks/00_x.ipynb"] == "notebooks/00_x.ipynb"
    assert moves["notebooks/01_y.ipynb"] == "results/h100/2026-12-01/partial/01_y.ipynb"
    assert moves["logs/cuda_tests.log"] == "results/h100/2026-12-01/cuda_tests.log"
    assert moves["summary.json"] == "results/h100/2026-12-01/summary.json"
    assert moves["snapshots/tinygpt_ch00.pickle"] == "tests/fixtures/snapshots/h100/tinygpt_ch00.pickle"
    assert "logs/kernel_01_y.pid" not in moves
    assert (root / "tests/fixtures/snapshots/h100/tinygpt_ch00.pickle").read_text() == "snap"
    (tmp_path / "out" / "results.tgz.00").unlink()
    with pytest.raises(SystemExit, match="none missing"):
        gi.import_results([tmp_path / "out"], root=root)


def test_concurrent_steps_share_the_cores_four_each():
    assert gs.workers(4, cores=16) == 4  # the lent machine: the memory-only lectures side by side
    assert gs.workers(4, cores=2) == 1  # a 2-core CPU rehearses the same steps one at a time
    assert gs.workers(2, cores=64) == 2 and gs.workers(1, cores=16) == 1
