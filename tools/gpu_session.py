"""The whole course on short GPU leases: a budgeted, ordered plan, rehearsed on a CPU, sized by a real lease.

A lent GPU gives 15 minutes of device time in all (its start included), at most 10 minutes a command and at most
8 files of 16 MiB back. The first lease (an H200, 2026-11-28) measured what the steps cost there: the wheels'
offline install 17 s, ``pytest -m cuda`` 53 s, bench qlora 16 s, bench attention about 50 s, and the ten lectures
at full scale about 1,000-1,200 s together (extrapolated from where each one was when its budget, projected from
the CPU, ran out: 40-250 s each, see LECTURE_GPU_S). The lectures do not fit one lease beside the rest, so:

  call 1 (<= 540 s): the environment, ``pytest -m cuda``, the GPU measurements and targets (bench qlora, the
      estimator traced on CUDA, CUDA memory snapshots, the diagnostic probe, bench attention, bench loss at a 128k
      vocabulary, bench offload's GPU table): what decides the GPU targets, in order of value;
  call 2 (<= 540 s, ``--limit`` lower after call 1 in the same lease): the lectures, those whose stored outputs
      name no GPU first; the memory-only ones four at a time with a quarter of the cores each, the timed ones alone;
      a lecture whose budget no longer fits the time left is not started (the next, shorter, one may be). Run it in
      each lease until every lecture's outputs come from a GPU.

Each step runs as a subprocess with a timeout (its budget): what it wrote before the budget ran out is kept,
and a killed step is recorded as 'timed out at N s'. Steps marked ``concurrent`` only measure memory
(``max_memory_allocated`` is per process) and run side by side within their stage; a stage that times
(``alone``) has the GPU to itself. After every stage the results are packed into $OUT: tar.gz chunks,
at most 8 files of at most 16 MiB (lowest-value files dropped first when they would not fit).

    python3 tools/gpu_session.py                 # call one, on the GPU (bash tools/gpu_session.sh)
    python3 tools/gpu_session.py --call 2        # the lectures (--limit 240 after call one in one lease)
    python3 tools/gpu_session.py --plan-only     # print the plan and the projected GPU time; run nothing
    python3 tools/gpu_session.py --rehearse      # the same steps, MEMLAB_SMALL=1, on this CPU, scaled budget
    python3 tools/gpu_session.py --online        # a GPU box of your own: pip installs from the registry
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT_S = {1: 540, 2: 540}
MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
INSTALL_DEADLINE_S = 35  # measured on the H200: 16.9 s for the 31 wheels

# Packages the device image lacks (its list: /work/.library/device/KINDS.md) that the session imports:
# the distribution name as a wheel file spells it (PEP 427: '-' and '.' become '_') -> import name.
REQUIRED = {
    "bitsandbytes": "bitsandbytes",
    "nbclient": "nbclient",
    "nbformat": "nbformat",
    "ipykernel": "ipykernel",
    "jupyter_client": "jupyter_client",
    "nbval": "nbval",
}

# ---- projection ------------------------------------------------------------------------------------
# Each lecture's GPU time at full scale, seconds, from the H200 lease of 2026-11-28: the wall time until its budget
# ran out (or it failed), divided by the share of the lecture's stored CPU cell times (nbclient's timing metadata)
# it had run by then. Lower bounds where the lecture failed (02, 08) or sat in one slow cell when killed. The four
# memory-only lectures ran side by side, each with all 16 cores' threads (oversubscribed): now a quarter each.
LECTURE_GPU_S = {"00": 63, "01": 232, "02": 116, "03": 65, "04": 85, "05": 199, "06": 128, "07": 256, "08": 51,
                 "09": 111}
LECTURE_MARGIN = 1.3  # budget = margin x the measured estimate, capped at the call's limit
# lectures whose stored outputs print times (perf_counter / time_median / tokens/s): they run alone
TIMED_LECTURES = {"01", "02", "03", "04", "07", "08"}
# memlab.config.describe()'s line, the first output of every lecture: "device cuda:0 (NVIDIA H200, 139.8 GiB, ...)"
DESCRIBED_ON_GPU = re.compile(r"^device cuda\S* \(", re.M)


def lecture_projection(chapter: str) -> float:
    return float(LECTURE_GPU_S.get(chapter, 120))


def stored_on_gpu(nb_path: Path) -> bool:
    """Whether a lecture's stored outputs come from a GPU: its describe() line names a CUDA device."""
    import json as _json

    nb = _json.loads(Path(nb_path).read_text())
    def joined(v) -> str:  # nbformat stores multi-line text as a list of lines or as one string
        return "".join(v) if isinstance(v, list) else str(v)

    text = "\n".join(joined(o.get("text", "")) + joined(o.get("data", {}).get("text/plain", ""))
                      for c in nb.get("cells", []) for o in c.get("outputs", []))
    return bool(DESCRIBED_ON_GPU.search(text))


@dataclass
class Step:
    """One unit of work: a command, its budget (s), the GPU seconds it is projected to take and why."""
    name: str
    cmd: list[str]
    budget_s: int
    projected_s: float
    basis: str
    concurrent: bool = False  # only measures memory: may share the GPU with the other concurrent steps
    collect: list[str] = field(default_factory=list)  # repo paths (globs) to pack after it ran
    call: int = 1
    needs_cuda: bool = False  # runs only on a GPU: a rehearsal on a CPU records its failure as expected


@dataclass
class Stage:
    """Steps that run together (all concurrent) or one step alone; the stage's budget bounds its wall time."""
    name: str
    steps: list[Step]

    @property
    def budget_s(self) -> int:
        return max(s.budget_s for s in self.steps)

    @property
    def projected_s(self) -> float:
        return max(s.projected_s for s in self.steps)


def lectures(root: Path = ROOT) -> list[Path]:
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _py() -> str:
    return sys.executable


def plan(call: int = 1) -> list[Stage]:
    """The ordered stages of a call (1: environment, CUDA tests, GPU measurements and targets; 2: lectures)."""
    me = [_py(), str(Path(__file__).resolve())]
    env = Stage("env", [Step("env", me + ["_env"], 60, 25, "H200 2026-11-28: wheels installed offline in 16.9 s, "
                                                           "+ nvidia-smi + memlab doctor", call=call)])
    if call == 2:
        return [env] + lecture_stages()
    return [env,
            Stage("cuda_tests", [Step(
                "cuda_tests", [_py(), "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rs", "tests"],
                100, 60, "H200 2026-11-28: 41 CUDA tests in 52.5 s")]),
            Stage("bench_qlora", [Step(  # it also times NF4 kernels vs bitsandbytes: alone
                "bench_qlora", me + ["_bench", "qlora"], 40, 17,
                "H200 2026-11-28: 16.3 s (NF4 vs bitsandbytes timed; 3 step peaks by max_memory_allocated)")]),
            Stage("measure_memory", [
                Step("estimator_cuda", [_py(), "results/h100/probes/gpu_estimator_check.py"], 60, 40,
                     "6 traces on CUDA fake tensors (CPU-bound; the 70B-class trace 20 s on 16 cores)", concurrent=True),
                Step("snapshots", me + ["_snapshot"], 60, 18, "H200 2026-11-28: 17.2 s", concurrent=True),
                Step("diag", [_py(), "results/h100/probes/gpu_diag.py"], 60, 25, "H100 2026-11-23 probe, ~20 s",
                     concurrent=True, needs_cuda=True)]),
            Stage("bench_attention", [Step(
                "bench_attention", me + ["_bench", "attention", "--only", "flash,triton,sdpa-flash", "--seqs",
                                         "1024,4096,16384"], 80, 50, "H200 2026-11-28: about 50 s")]),
            Stage("bench_loss", [Step(
                "bench_loss", me + ["_bench", "loss", "--vocabs", "128256", "--tokens", "4096,16384"], 80, 60,
                "the 128k targets only; the full default ran past 75 s on the H200 (6 sizes x 6 kernels)")]),
            Stage("bench_offload", [Step(
                "bench_offload", me + ["_bench", "offload", "--no-cpu", "--repeat", "3"], 120, 100,
                "8 recipes x 5 steps of 16 micro-batches on 302M params, ~0.9-3 s a step (H100 2026-11-23)",
                needs_cuda=True)]),
            ]


def lecture_stages(root: Path = ROOT) -> list[Stage]:
    """The lectures of call 2: those whose stored outputs name no GPU first, then the rest; within each group the
    memory-only lectures side by side in one stage, then the timed ones alone, shortest first."""
    steps = []
    for nb in lectures(root):
        ch = nb.name[:2]
        proj = lecture_projection(ch)
        steps.append(Step(f"lecture_{nb.stem}", [_py(), str(Path(__file__).resolve()), "_notebook",
                                                  str(nb.relative_to(root))],
                          int(min(CALL_LIMIT_S[2] - 50, round(proj * LECTURE_MARGIN))), proj,
                          f"H200 2026-11-28 extrapolated ({'alone' if ch in TIMED_LECTURES else 'side by side'})",
                          concurrent=ch not in TIMED_LECTURES, collect=[str(nb.relative_to(root))], call=2))
    stages: list[Stage] = []
    for done in (False, True):
        group = [s for s in steps if stored_on_gpu(root / s.collect[0]) == done]
        side = [s for s in group if s.concurrent]
        if side:
            stages.append(Stage("lectures_memory" + ("_again" if done else ""), side))
        stages += [Stage(s.name, [s]) for s in sorted((s for s in group if not s.concurrent),
                                                      key=lambda s: s.projected_s)]
    return stages


def total(stages: list[Stage], attr: str = "budget_s") -> float:
    return sum(getattr(s, attr) for s in stages)


def format_plan(stages: list[Stage], call: int) -> str:
    rows = [f"call {call} (limit {CALL_LIMIT_S[call]} s): stage / step, budget s, projected GPU s, basis"]
    for st in stages:
        tag = "concurrent" if len(st.steps) > 1 else "alone"
        rows.append(f"[{st.name}] {tag}: budget {st.budget_s} s, projected {st.projected_s:.0f} s")
        for s in st.steps:
            rows.append(f"    {s.name:<40} {s.budget_s:>4} {s.projected_s:>6.1f}  {s.basis}")
    rows.append(f"total budget {total(stages):.0f} s (limit {CALL_LIMIT_S[call]} s); "
                f"projected GPU time {total(stages, 'projected_s'):.0f} s "
                f"({total(stages, 'projected_s') / 60:.1f} min)")
    return "\n".join(rows)


# ---- wheels ----------------------------------------------------------------------------------------
def wheel_dist(filename: str) -> str:
    """The normalised distribution name of a wheel file (PEP 427: name-version-...-platform.whl)."""
    if not filename.endswith(".whl") or filename.count("-") < 4:
        raise ValueError(f"wheel filename {filename!r}: expected NAME-VERSION-PY-ABI-PLATFORM.whl")
    return re.sub(r"[-_.]+", "_", filename.split("-")[0]).lower()


def check_wheels(whl_dir: Path, required=REQUIRED) -> list[str]:
    """The required distributions with no wheel in ``whl_dir`` (one version each: two of one name stop pip)."""
    whl_dir = Path(whl_dir)
    have: dict[str, list[str]] = {}
    for f in sorted(whl_dir.glob("*.whl")) if whl_dir.is_dir() else []:
        have.setdefault(wheel_dist(f.name), []).append(f.name)
    dup = {k: v for k, v in have.items() if len(v) > 1}
    if dup:
        raise SystemExit(f"gpu_session: two versions of one package in {whl_dir}: {dup}; keep one")
    return [name for name in required if re.sub(r"[-_.]+", "_", name).lower() not in have]


def missing_wheel_line(missing: list[str], whl_dir: Path) -> str:
    return (f"gpu_session: FAIL no wheel for {', '.join(missing)} in {whl_dir}/ "
            f"(run tools/fetch_wheels.sh here, then carry .whl; or --online on a machine with network)")


def env_step(out: Path, online: bool, whl: Path | None = None) -> int:
    """Install the wheels (offline from ``whl``, default .whl/) or from the registry (``online``), check that
    they import, and print the GPU; a missing wheel ends it at once with one line naming it (exit 3)."""
    t0 = time.monotonic()
    whl = ROOT / ".whl" if whl is None else Path(whl)
    if os.environ.get("GPU_SESSION_REHEARSE") == "1":  # this CPU: the .venv has what it has; say what .whl/ lacks
        missing = check_wheels(whl)
        print(missing_wheel_line(missing, whl).replace("FAIL", "(rehearsal, not fatal)") if missing
              else f"gpu_session: every required wheel is in {whl}/", flush=True)
        cmd = None
    elif online:
        cmd = [_py(), "-m", "pip", "install", "-q", *REQUIRED]
    else:
        missing = check_wheels(whl)
        if missing:
            print(missing_wheel_line(missing, whl), flush=True)
            return 3
        cmd = [_py(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--upgrade", "--target", "/tmp/site", *map(str, sorted(whl.glob("*.whl")))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_DEADLINE_S) if cmd else None
    if r is not None and r.returncode:
        print(f"gpu_session: FAIL pip install exited {r.returncode}: {r.stderr.strip()[-400:]}", flush=True)
        return r.returncode
    probe = "import importlib,sys; [importlib.import_module(m) for m in sys.argv[1:]]"
    mods = [m for m in REQUIRED.values() if not (cmd is None and m == "bitsandbytes")]
    r = subprocess.run([_py(), "-c", probe, *mods], capture_output=True, text=True,
                       timeout=max(1, INSTALL_DEADLINE_S - (time.monotonic() - t0)))
    if r.returncode:
        print(f"gpu_session: FAIL import after install: {r.stderr.strip().splitlines()[-1]}", flush=True)
        return 4
    print(f"gpu_session: wheels installed and importable in {time.monotonic() - t0:.1f} s", flush=True)
    for c in (["nvidia-smi"], [_py(), "-m", "memlab", "doctor"]):
        try:
            r = subprocess.run(c, capture_output=True, text=True, timeout=10)
            print(r.stdout + r.stderr, flush=True)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"{c[0]}: {e}", flush=True)
    return 0


# ---- the steps' own bodies (run as subprocesses of the planner) ------------------------------------
def run_notebook(path: str, out: Path) -> int:
    """Execute a notebook with nbclient and write it back after every cell (a killed run keeps its cells)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str((ROOT / path).parent)}})
    dest = out / "notebooks" / Path(path).name
    dest.parent.mkdir(parents=True, exist_ok=True)
    import signal

    def stop(signum, frame):  # the planner's timeout: leave setup_kernel's block, which shuts the kernel down
        raise SystemExit(124)

    signal.signal(signal.SIGTERM, stop)
    try:
        with client.setup_kernel():
            prov = getattr(client.km, "provisioner", None)
            pid = getattr(getattr(prov, "process", None), "pid", None) or getattr(prov, "pid", None)
            if pid:  # the kernel runs in its own session: the planner ends it by this id on a timeout
                (out / "logs").mkdir(parents=True, exist_ok=True)
                (out / "logs" / f"kernel_{Path(path).stem}.pid").write_text(f"{pid}\n")
            for i, cell in enumerate(nb.cells):
                client.execute_cell(cell, i)
                nbformat.write(nb, dest)
    finally:
        nbformat.write(nb, dest)
    return 0


def run_snapshot(out: Path) -> int:
    """A CUDA memory snapshot (allocator history) of one training step of each chapter's models."""
    import torch

    sys.path.insert(0, str(ROOT / "utils"))
    from memlab.models import TinyGPT, TinyGPTConfig, tiny_llama

    small = os.environ.get("MEMLAB_SMALL") == "1" or not torch.cuda.is_available()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cases = {
        "tinygpt_ch00": lambda: TinyGPT(TinyGPTConfig(n_layer=4 if small else 8, n_embd=128 if small else 512)),
        "tinygpt_sdpa_ch05": lambda: TinyGPT(TinyGPTConfig(n_layer=4, n_embd=128 if small else 512, attention="sdpa")),
        "tiny_llama_ch06": lambda: tiny_llama(),
    }
    (out / "snapshots").mkdir(parents=True, exist_ok=True)
    for name, build in cases.items():
        model = build().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (2 if small else 8, 64 if small else 128), device=dev)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        out_ = model(x) if isinstance(model, TinyGPT) else model(input_ids=x).logits
        logits = out_[0] if isinstance(out_, tuple) else out_
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
        opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()
            path = out / "snapshots" / f"{name}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"{name}: max_memory_allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, "
                  f"snapshot {path.stat().st_size / 2**20:.2f} MiB", flush=True)
        else:
            print(f"{name}: one step ran on cpu; no CUDA snapshot on a CPU (rehearsal)", flush=True)
        del model, opt
    return 0


# ---- running, with budgets -------------------------------------------------------------------------
def run_step(step: Step, work: Path, budget: float, env: dict) -> dict:
    log = work / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(step.cmd) + "\n")
        fh.flush()
        p = subprocess.Popen(step.cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=budget)
            status = "ok" if rc == 0 else f"failed rc={rc}"
            if rc and step.needs_cuda and env.get("GPU_SESSION_REHEARSE") == "1":
                status += " (needs CUDA: expected on a CPU)"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)  # the step's own process group; a notebook shuts its kernel down
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc, status = None, f"timed out at {budget:.0f} s"
        for pidfile in (work / "logs").glob("kernel_*.pid"):
            if step.name.endswith(pidfile.stem[len("kernel_"):]):
                try:
                    os.kill(int(pidfile.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
                pidfile.unlink()
        wall = time.monotonic() - t0
        fh.write(f"\n[gpu_session] {step.name}: {status}, {wall:.1f} s\n")
    return {"step": step.name, "status": status, "rc": rc, "wall_s": round(wall, 1), "budget_s": round(budget, 1),
            "projected_gpu_s": step.projected_s, "concurrent": step.concurrent}


def value_order(work: Path) -> list[Path]:
    """Files to pack, most valuable first: summary and logs, snapshots, then notebooks (largest last)."""
    files = [p for p in work.rglob("*") if p.is_file()]
    rank = {"summary.json": 0}

    def key(p: Path):
        top = p.relative_to(work).parts[0]
        return (rank.get(p.name, {"logs": 1, "snapshots": 3, "notebooks": 2}.get(top, 4)), p.stat().st_size, str(p))

    return sorted(files, key=key)


def pack(work: Path, out: Path, max_files: int = MAX_FILES, max_bytes: int = MAX_FILE_BYTES) -> dict:
    """Pack ``work`` into ``out`` as results.tgz.NN chunks of at most ``max_bytes``, at most ``max_files`` in all.

    Files go in by value (value_order); when the archive would need more than ``max_files`` chunks, the
    lowest-value files are left out and named in the returned dict (and in dropped.txt inside the archive).
    """
    out.mkdir(parents=True, exist_ok=True)
    files = value_order(work)
    dropped: list[str] = []
    while True:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(work)))
            if dropped:
                data = ("\n".join(dropped) + "\n").encode()
                info = tarfile.TarInfo("dropped.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        blob = buf.getvalue()
        chunks = max(1, -(-len(blob) // max_bytes))
        if chunks <= max_files or not files:
            break
        dropped.append(str(files.pop().relative_to(work)))
    for old in out.glob("results.tgz.*"):
        old.unlink()
    names = []
    for i in range(chunks):
        name = out / f"results.tgz.{i:02d}"
        tmp = name.with_suffix(".tmp")
        tmp.write_bytes(blob[i * max_bytes:(i + 1) * max_bytes])
        tmp.rename(name)
        names.append(name.name)
    return {"chunks": names, "bytes": len(blob), "dropped": dropped}


def workers(n_steps: int, cores: int | None = None) -> int:
    """Concurrent steps at once: one per 4 CPU cores (a notebook kernel and its data loading need a few),
    so 4 on the lent machine's 16 cores and one at a time (the same steps, serially) on a 2-core CPU."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    return max(1, min(n_steps, cores // 4))


def step_env(base: dict, threads: int | None) -> dict:
    """A step's environment: ``threads`` caps its intra-op threads (a quarter of the cores each for four lectures
    side by side; the H200 lease ran them with 16 threads each on 16 cores)."""
    if threads is None:
        return base
    return dict(base, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))


def fits(step: Step, budget_s: float, left_s: float) -> bool:
    """Whether a step starts with ``left_s`` of the call left: a lecture only with its whole budget (one cut off
    stores nothing), any other step when 5 s are left (what it wrote before its timeout is kept)."""
    return left_s >= (budget_s if step.name.startswith("lecture_") else 5)


def execute(call: int, out: Path, rehearse: bool, scale: float, only: list[str] | None, online: bool,
            limit_s: float | None = None) -> int:
    stages = plan(call)
    if only:
        stages = [Stage(st.name, [s for s in st.steps if any(o in s.name for o in only)]) for st in stages]
        stages = [st for st in stages if st.steps]
    work = Path(os.environ.get("GPU_SESSION_WORK", "/tmp/gpu_session_work"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", GPU_SESSION_OUT=str(work))
    site = "/tmp/site"
    if not rehearse and not online:
        env["PYTHONPATH"] = os.pathsep.join([site, str(ROOT / "utils"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["PATH"] = f"{site}/bin:{env['PATH']}"
    if rehearse:
        env["MEMLAB_SMALL"] = "1"
        env["GPU_SESSION_REHEARSE"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env.pop("MEMLAB_SMALL", None)
    t_start = time.monotonic()
    summary = {"call": call, "rehearse": rehearse, "scale": scale, "steps": [], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    limit = (limit_s if limit_s is not None else CALL_LIMIT_S[call]) * scale
    print(f"gpu_session: call {call}, {'rehearsal on ' + os.uname().machine + ' CPU' if rehearse else 'GPU'}, "
          f"limit {limit:.0f} s", flush=True)
    for st in stages:
        n_workers = workers(len(st.steps))
        threads = None if rehearse or len(st.steps) == 1 else max(1, (os.cpu_count() or 1) // n_workers)

        def launch(s: Step) -> dict:  # the call's remaining time bounds each step when it starts
            left_now = limit - (time.monotonic() - t_start)
            if not fits(s, s.budget_s * scale, left_now):
                return {"step": s.name, "status": f"not started: needs {s.budget_s * scale:.0f} s, {left_now:.0f} s left",
                        "rc": None, "wall_s": 0.0, "budget_s": 0.0, "projected_gpu_s": s.projected_s,
                        "concurrent": s.concurrent}
            return run_step(s, work, min(s.budget_s * scale, left_now), step_env(env, threads))

        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            rows = list(pool.map(launch, st.steps))
        for r in rows:
            r["stage"] = st.name
            summary["steps"].append(r)
            print(f"  {r['step']:<40} {r['status']:<22} {r['wall_s']:>7.1f} s (budget {r['budget_s']:.0f}, "
                  f"projected GPU {r['projected_gpu_s']:.0f} s)", flush=True)
        log = work / "logs" / "env.log"
        if st.name == "env" and not rehearse and "wheels installed and importable" not in (
                log.read_text() if log.exists() else ""):  # a slow doctor after the install is no reason to stop
            print(log.read_text()[-600:] if log.exists() else "gpu_session: env wrote no log", flush=True)
            summary["aborted"] = "env failed"
            _write_summary(work, summary, t_start)
            pack(work, out)
            return 3
        _write_summary(work, summary, t_start)
        summary["pack"] = pack(work, out)
    _write_summary(work, summary, t_start)
    summary["pack"] = pack(work, out)
    proj = total(stages, "projected_s")
    if rehearse:
        rows = [r for r in summary["steps"] if "wall_s" in r]
        late = [r["step"] for r in rows if r["status"] != "ok" and "expected on a CPU" not in r["status"]]
        print(f"rehearsal: measured CPU time {sum(r['wall_s'] for r in rows):.0f} s over {len(rows)} steps; "
              f"projected GPU time {proj:.0f} s (H200-measured table)"
              + (f"; not finished within the scaled budget: {', '.join(late)}" if late else ""), flush=True)
    print(f"gpu_session: done in {time.monotonic() - t_start:.0f} s; packed {summary['pack']['chunks']} "
          f"({summary['pack']['bytes'] / 2**20:.2f} MiB, dropped {len(summary['pack']['dropped'])}); "
          f"projected GPU time of this call {proj:.0f} s ({proj / 60:.1f} min)", flush=True)
    return 0


def _write_summary(work: Path, summary: dict, t_start: float) -> None:
    summary["wall_s"] = round(time.monotonic() - t_start, 1)
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(os.environ.get("GPU_SESSION_OUT") or os.environ.get("OUT") or ROOT / "gpu-out")
    if argv and argv[0] == "_notebook":
        return run_notebook(argv[1], out)
    if argv and argv[0] == "_snapshot":
        return run_snapshot(out)
    if argv and argv[0] == "_env":
        return env_step(out, online=os.environ.get("GPU_SESSION_ONLINE") == "1")
    if argv and argv[0] == "_bench":
        return subprocess.call([_py(), "-m", "memlab", "bench", *argv[1:]], cwd=ROOT)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call", type=int, choices=(1, 2), default=1)
    ap.add_argument("--plan-only", action="store_true", help="print the plan and the projection; run nothing")
    ap.add_argument("--rehearse", action="store_true", help="MEMLAB_SMALL=1 on this CPU, budgets x --scale")
    ap.add_argument("--scale", type=float, default=None, help="budget factor (default 1 on a GPU, 2 rehearsing)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of step names (a partial run)")
    ap.add_argument("--online", action="store_true", help="install the missing packages from the registry")
    ap.add_argument("--limit", type=float, default=None, help="the call's time limit in s (default: 540); lower it "
                    "for call 2 after call 1 in the same lease")
    args = ap.parse_args(argv)
    stages = plan(args.call)
    print(format_plan(stages, args.call), flush=True)
    if args.plan_only:
        return 0
    scale = args.scale if args.scale is not None else (2.0 if args.rehearse else 1.0)
    if scale <= 0:
        ap.error(f"--scale {scale}: must be > 0")
    if args.online:
        os.environ["GPU_SESSION_ONLINE"] = "1"
    if args.limit is not None and not 0 < args.limit <= 600:
        ap.error(f"--limit {args.limit}: allowed: more than 0 and at most 600 s (one device command's limit)")
    return execute(args.call, out, args.rehearse, scale, args.only.split(",") if args.only else None, args.online,
                   args.limit)


if __name__ == "__main__":
    sys.exit(main())
