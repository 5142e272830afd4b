"""The memlab command's rough edges (issue 26): argument errors in one line, "did you mean" for
commands and model presets, chapter numbers for grade, and `make grade`'s exit status."""
from __future__ import annotations

import os
import shutil
import time
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class _Run:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def memlab_cli(capsys):
    """The memlab command in this process (fast: no fresh interpreter importing torch each time)."""
    import argparse

    from memlab import cli

    def run(*args: str) -> _Run:
        original = argparse.ArgumentParser.error
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse exits
            code = exc.code
        finally:
            argparse.ArgumentParser.error = original  # other tests in this process see argparse as it is
        out = capsys.readouterr()
        return _Run(code, out.out, out.err)

    return run


def _memlab(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "utils")}
    return subprocess.run([sys.executable, "-m", "memlab", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.parametrize("args, expected", [
    (["grade", "--bogus"], "memlab grade: error: unrecognized arguments: --bogus (memlab grade --help for usage)"),
    (["labs", "frob"], "memlab labs: error: argument action: invalid choice: 'frob'"),
    (["doctor", "--x"], "memlab doctor: error: unrecognized arguments: --x (memlab doctor --help for usage)"),
    (["estimate", "llama-2-7b", "--bogus"], "memlab estimate: error: unrecognized arguments: --bogus (memlab estimate --help"),
    (["plan", "llama-3-8b"], "memlab plan: error: the following arguments are required: --batch-size, --seq-len"),
])
def test_argument_errors_are_one_line_without_the_usage_block(memlab_cli, args, expected):
    if args[0] in ("estimate", "plan"):
        pytest.importorskip("transformers")
    proc = memlab_cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert "usage:" not in proc.stderr and proc.stdout == ""


def test_help_still_prints_the_usage(memlab_cli):
    proc = memlab_cli("grade", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: memlab grade")


def test_unknown_command_suggests_the_close_one(memlab_cli):
    proc = memlab_cli("estimat", "llama-2-7b")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "memlab: unknown command 'estimat' (did you mean estimate?); allowed: doctor, grade, labs, bench, estimate, plan, explain"]


@pytest.mark.parametrize("typo, preset", [("llama-2-7", "llama-2-7b"), ("Mistral-7B", "mistral-7b"), ("lama-3-8b", "llama-3-8b")])
def test_model_typos_get_a_did_you_mean(typo, preset):
    pytest.importorskip("transformers")
    from memlab.estimate import estimate_training_memory
    from memlab.models import UnknownPresetError

    with pytest.raises(UnknownPresetError, match=rf"model='{typo}' is invalid; allowed: a preset .*\(did you mean {preset}\?\)"):
        estimate_training_memory(typo, batch_size=1, seq_len=8)


def test_model_typo_on_the_command_line_is_one_line_with_the_suggestion():
    pytest.importorskip("transformers")
    proc = _memlab("estimate", "llama-2-7", "--gpu", "24GB")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("memlab estimate: error: model='llama-2-7' is invalid; allowed: a preset"), line
    assert line.endswith("(did you mean llama-2-7b?)"), line


def test_plan_model_typo_suggests_the_preset():
    pytest.importorskip("transformers")
    from memlab.plan import plan

    with pytest.raises(ValueError, match=r"is invalid; allowed: a preset .*\(did you mean llama-3-8b\?\)"):
        plan("lama-3-8b", "24GiB", batch_size=1, seq_len=64)


def test_grade_takes_a_chapter_number(tmp_path):
    (tmp_path / "labs").mkdir()
    lab = next((ROOT / "labs").glob("00_*.ipynb"))
    shutil.copy(lab, tmp_path / "labs" / lab.name)
    missing = _memlab("grade", "7", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "memlab grade: chapter '7': no labs/07_*.ipynb; allowed: 00, or a notebook's path"
    from memlab.course import grading

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert grading.chapter_path("0") == Path("labs") / lab.name
        assert grading.chapter_path("00") == Path("labs") / lab.name
        (tmp_path / "work").mkdir()
        shutil.copy(lab, tmp_path / "work" / lab.name)
        assert grading.chapter_path("00") == Path("work") / lab.name  # work/ first, as with no argument
        assert grading.chapter_path(str(lab)) == lab  # a path stays a path
    finally:
        os.chdir(cwd)


MAKE = shutil.which("make")


@pytest.mark.skipif(MAKE is None, reason="needs GNU make")
@pytest.mark.parametrize("code, make_ok", [(0, True), (1, True), (2, False)])
def test_make_grade_fails_only_when_the_grader_cannot_grade(tmp_path, code, make_ok):
    """`make grade` with a stub memlab exiting 0 (full marks), 1 (not yet) and 2 (could not grade)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "memlab"
    stub.write_text(f"#!/bin/sh\necho \"graded $*\"\nexit {code}\n")
    stub.chmod(0o755)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")  # the set-up's order-only prerequisite
    (venv / "bin" / "python").chmod(0o755)
    stamp = tmp_path / "stamp"
    stamp.touch()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run([MAKE, "-s", "-C", str(ROOT), "grade", f"VENV={venv}", f"STAMP={stamp}", "LAB=04"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "graded grade 04"
    assert (proc.returncode == 0) == make_ok, proc.stderr
    assert ("Error" in proc.stderr) == (not make_ok), proc.stderr


def test_reset_of_an_untouched_lab_makes_no_backup(tmp_path):
    from memlab.course import labs

    shutil.copytree(ROOT / "labs", tmp_path / "labs")
    labs.start(tmp_path)
    fresh, backup = labs.reset("00", tmp_path)
    assert backup is None and not (tmp_path / "work" / "backups").exists()
    text = fresh.read_text()
    fresh.write_text(text.replace("NotImplementedError", "NotImplementedError  # my edit", 1))
    old = time.time() - 60
    os.utime(fresh, (old, old))  # saved a minute ago: a reset refuses a file changed in the last seconds
    _, backup = labs.reset("00", tmp_path)
    assert backup is not None and "# my edit" in backup.read_text()


def test_argparse_is_left_as_it_was_after_an_in_process_call(memlab_cli):
    import argparse

    before = argparse.ArgumentParser.error
    from memlab import cli

    with pytest.raises(SystemExit):
        cli.main(["grade", "--bogus"])
    assert argparse.ArgumentParser.error is before


_NO_TORCH_BEFORE_THE_ERROR = """
import sys
from memlab import cli
try:
    code = cli.main({argv!r})
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("CODE", code, "HEAVY", ",".join(heavy) or "-")
"""


@pytest.mark.parametrize("argv, message", [
    (["estimate", "--batch-size", "x", "llama-2-7b"], "argument --batch-size: 'x' is not an int"),
    (["estimate", "--bogus", "llama-2-7b"], "unrecognized arguments: --bogus"),
    (["estimate", "--dtype", "fp8", "llama-2-7b"], "argument --dtype: invalid choice: 'fp8'"),
    (["estimate"], "the following arguments are required: model (or --validate)"),
    (["plan", "llama-2-7b", "--batch-size", "0", "--seq-len", "512"], "argument --batch-size: '0' is invalid"),
    (["plan", "llama-2-7b", "--seq-len", "512"], "the following arguments are required: --batch-size"),
])
def test_estimate_and_plan_argument_errors_come_before_torch_is_imported(argv, message):
    """The parsers live in memlab.cli.args: an argument error exits 2 with one line and torch
    (and transformers) never imported, instead of after their 1-4 s import."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "utils")}
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH_BEFORE_THE_ERROR.format(argv=argv)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.split() == ["CODE", "2", "HEAVY", "-"], (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].startswith(f"memlab {argv[0]}: error: ") and lines[0].endswith(f"(memlab {argv[0]} --help for usage)")


def test_a_good_command_line_still_imports_torch():
    """The check above can fail: a command line that parses goes on to the command, whose trace imports torch and
    transformers; and a model that refuses the settings says so before either is imported, as a bad argument does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "utils"), "MEMLAB_CACHE_DIR": "none"}

    def run(argv):
        proc = subprocess.run([sys.executable, "-c", _NO_TORCH_BEFORE_THE_ERROR.format(argv=argv)],
                              capture_output=True, text=True, env=env, timeout=180)
        return proc, proc.stdout.strip().splitlines()[-1].split()

    proc, last = run(["estimate", "gpt2", "--batch-size", "1", "--seq-len", "64"])
    assert last[:3] == ["CODE", "0", "HEAVY"] and last[3] == "torch,transformers", (last, proc.stderr[-500:])
    proc, last = run(["estimate", "gpt2"])  # parses; gpt2's 1024 positions against the default 2048 tokens
    assert last == ["CODE", "2", "HEAVY", "-"], (last, proc.stderr[-500:])
    assert "seq_len=2048 exceeds gpt2's n_positions=1024" in proc.stderr


def test_cli_args_name_lists_equal_the_estimate_constants():
    """memlab.cli.args keeps torch-free copies of the choices: they must equal the real ones."""
    from memlab.estimate import adapters
    from memlab.estimate import recipes as E
    from memlab.cli import args as cli_args
    from memlab.core.vocab import OPTIMIZER_ALIASES

    assert list(cli_args.DTYPE_CHOICES) == list(E.DTYPES) + list(E.DTYPE_ALIASES)
    assert list(cli_args.OPTIMIZER_CHOICES) == list(E.OPTIMIZERS) + list(OPTIMIZER_ALIASES)
    assert tuple(cli_args.OPTIMIZER_IMPLS) == tuple(E.OPTIMIZER_IMPLS)
    assert tuple(cli_args.LOSSES) == tuple(E.LOSSES)
    assert tuple(cli_args.ATTN_IMPLEMENTATIONS) == tuple(E.ATTN_IMPLEMENTATIONS)
    assert tuple(cli_args.ZERO_STAGES) == tuple(E.ZERO_STAGES)
    assert tuple(cli_args.ADAPTERS) == tuple(adapters.ADAPTERS)
    assert tuple(cli_args.ADAPTER_DTYPES) == tuple(adapters.ADAPTER_DTYPES)
    assert (cli_args.MAX_BATCH, cli_args.MAX_SEQ_LEN, cli_args.MAX_WORLD_SIZE) == (
        E.MAX_BATCH, E.MAX_SEQ_LEN, E.MAX_WORLD_SIZE)


def test_estimate_help_names_the_presets_and_dtypes(memlab_cli):
    """The help's heavy parts (presets, dtype descriptions) are filled in when it is printed."""
    from memlab import estimate as E
    from memlab.models import PRESETS

    r = memlab_cli("estimate", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert all(name in text for name in PRESETS)
    assert " ".join(E.DTYPES["bf16-pure"].split()) in text


def test_estimate_leaving_by_os_exit_prints_all_it_prints_the_normal_way(tmp_path):
    """`memlab estimate` skips the interpreter's teardown (os._exit after flushing): piped into a file, its
    output is the one the normal exit prints, line for line (bar the timing), and its exit status is kept."""
    pytest.importorskip("transformers")

    def run(quick: str, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "utils"), "MEMLAB_CACHE_DIR": "none",
               "MEMLAB_QUICK_EXIT": quick, "OMP_NUM_THREADS": "1"}
        return subprocess.run([sys.executable, "-m", "memlab", "estimate", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240)

    def lines(proc: subprocess.CompletedProcess) -> list[str]:
        return [ln for ln in proc.stdout.splitlines() if not ln.startswith("estimated in ")]

    quick, normal = run("1", "llama-2-7b", "--seq-len", "256"), run("0", "llama-2-7b", "--seq-len", "256")
    assert quick.returncode == normal.returncode == 0, quick.stderr + normal.stderr
    assert quick.stdout.rstrip().splitlines()[-1].startswith("estimated in "), quick.stdout[-300:]
    assert lines(quick) == lines(normal) and len(lines(quick)) > 10
    bad = run("1", "no-such-model-xyz")
    assert bad.returncode == 2 and "no-such-model-xyz" in bad.stderr + bad.stdout, (bad.returncode, bad.stderr)


@pytest.mark.parametrize("command,env_gc,enabled", [("estimate", None, False), ("plan", None, False),
                                                    ("estimate", "1", True), ("explain", None, True),
                                                    ("bench", None, True)])
def test_estimate_and_plan_run_with_the_cyclic_collector_off(command, env_gc, enabled):
    """The console script runs ``estimate`` and ``plan`` with gc disabled (their imports a quarter faster), every other
    command with it on, and ``MEMLAB_GC=1`` keeps it on; what the command sees is asked from inside it."""
    code = ("import gc, sys, memlab.cli as c\n"
            "c.main = lambda argv: print('gc', gc.isenabled(), argv[0]) or 0\n"
            f"sys.argv = ['memlab', {command!r}, 'x']\n"
            "c.console()\n")
    env = {k: v for k, v in os.environ.items() if k != "MEMLAB_GC"}
    env["PYTHONPATH"] = str(ROOT / "utils")
    if env_gc is not None:
        env["MEMLAB_GC"] = env_gc
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert proc.stdout.split() == ["gc", str(enabled), command]
