"""``memlab labs reset`` never loses a save (issue 41.1): the learner's file moves into backups/
with one rename, the reset is refused while the file looks busy (JupyterLab's ``.~NAME`` copy, a
change in the last seconds, a process holding it open for writing), every OS error names the path,
and a reset raced against jupyter_server's own save at 20 seeded instants loses no version."""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from memlab.course import labs, workspace

ROOT = Path(__file__).resolve().parents[2]
LAB = "00_where_the_memory_goes.ipynb"


def _course(tmp_path: Path) -> Path:
    root = tmp_path / "course"
    (root / "labs").mkdir(parents=True)
    shutil.copyfile(ROOT / "labs" / LAB, root / "labs" / LAB)
    return root


def _edited(root: Path, note: str, pad: int = 0) -> bytes:
    """The lab with one markdown cell added: a learner's version (``pad`` characters more)."""
    nb = json.loads((root / "labs" / LAB).read_text())
    nb["cells"].append({"cell_type": "markdown", "id": "learner-note", "metadata": {}, "source": note + "x" * pad})
    return (json.dumps(nb, indent=1) + "\n").encode()


def _learner_copy(root: Path, note: str = "my notes", age: float = 60.0) -> Path:
    """work/LAB holding the learner's changes, last changed ``age`` seconds ago."""
    labs.start(root)
    path = root / "work" / LAB
    path.write_bytes(_edited(root, note))
    old = time.time() - age
    os.utime(path, (old, old))
    return path


def _cli(root: Path, *argv: str, capsys) -> tuple[int, list[str]]:
    rc = labs.main([*argv, "--root", str(root)])
    return rc, capsys.readouterr().err.strip().splitlines()


def test_reset_moves_the_learners_file_with_one_rename(tmp_path):
    root = _course(tmp_path)
    path = _learner_copy(root)
    before = os.stat(path)
    mine = path.read_bytes()
    fresh, backup = labs.reset("00", root)
    assert backup is not None and backup.parent == root / "work" / "backups"
    after = os.stat(backup)
    # the same file (inode), moved: a writer still holding it writes into the backup, never into nothing
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert backup.read_bytes() == mine and after.st_mtime == before.st_mtime
    assert fresh.read_bytes() == (root / "labs" / LAB).read_bytes()


def test_reset_refuses_a_file_changed_in_the_last_seconds(tmp_path, capsys):
    root = _course(tmp_path)
    path = _learner_copy(root, age=0.5)
    mine = path.read_bytes()
    rc, err = _cli(root, "reset", "00", capsys=capsys)
    assert rc == 1 and len(err) == 1, err
    assert f"{path}: changed " in err[0] and "s ago" in err[0] and "nothing was changed" in err[0], err
    assert path.read_bytes() == mine and not (root / "work" / "backups").exists()
    # an untouched fresh copy is no save to protect: resetting it at once is fine
    path.write_bytes((root / "labs" / LAB).read_bytes())
    assert labs.reset("00", root)[1] is None and not (root / "work" / "backups").exists()


@pytest.mark.skipif(not Path("/proc/self/fdinfo").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("mode", ["r+", "a", "w+"])
def test_reset_refuses_a_file_open_for_writing(tmp_path, capsys, mode):
    root = _course(tmp_path)
    path = _learner_copy(root)
    mine = path.read_bytes()
    with open(path, mode) as fh:
        os.utime(path, (time.time() - 60, time.time() - 60))
        rc, err = _cli(root, "reset", "00", capsys=capsys)
        assert rc == 1 and len(err) == 1 and f"open for writing by process {os.getpid()}" in err[0], err
        assert workspace.open_for_writing(path) == [f"{os.getpid()} ({Path('/proc/self/comm').read_text().strip()})"]
        if mode == "w+":
            fh.write(mine.decode())
    assert path.read_bytes() == mine and not (root / "work" / "backups").exists()
    os.utime(path, (time.time() - 60, time.time() - 60))
    with open(path, "rb"):  # read-only: not a writer
        assert workspace.open_for_writing(path) == []
        assert labs.reset("00", root)[1] is not None


def test_reset_refuses_while_jupyterlab_saves(tmp_path, capsys):
    """jupyter_server's atomic_writing copies the previous version to ``.~NAME``, rewrites the file in
    place and removes ``.~NAME`` when done: while it exists the file may be half written."""
    fileio = pytest.importorskip("jupyter_server.services.contents.fileio")
    root = _course(tmp_path)
    path = _learner_copy(root)
    mine = path.read_bytes()
    temp = Path(fileio.path_to_intermediate(str(path)))
    temp.write_bytes(mine)
    rc, err = _cli(root, "reset", "00", capsys=capsys)
    assert rc == 1 and len(err) == 1 and f"JupyterLab is saving it ({temp} exists)" in err[0], err
    assert path.read_bytes() == mine and temp.read_bytes() == mine
    assert workspace.jupyter_temp(path) == temp


def test_a_file_saved_again_during_the_reset_is_kept(tmp_path, monkeypatch):
    """A save that recreates the notebook between the move and the fresh copy wins: the copy never
    replaces it."""
    root = _course(tmp_path)
    path = _learner_copy(root, note="previous")
    previous = path.read_bytes()
    saved = _edited(root, "saved meanwhile")
    real = workspace._temp_copy

    def save_meanwhile(src, target):
        tmp = real(src, target)
        target.write_bytes(saved)  # what JupyterLab's save does when the file is gone: creates it
        return tmp

    monkeypatch.setattr(workspace, "_temp_copy", save_meanwhile)
    with pytest.raises(labs.LabFileError, match="was written again while being reset") as info:
        labs.reset("00", root)
    assert str(path) in str(info.value) and "your copy before it is" in str(info.value)
    assert path.read_bytes() == saved
    (backup,) = (root / "work" / "backups").iterdir()
    assert backup.read_bytes() == previous
    assert not [p for p in (root / "work").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("action", ["start", "reset"])
def test_a_full_disk_names_the_path(tmp_path, monkeypatch, capsys, action):
    """ENOSPC from a write names no file; the message names the notebook all the same, in one line."""
    root = _course(tmp_path)
    if action == "reset":
        _learner_copy(root)
    else:
        (root / "work").mkdir()
    real_fdopen = workspace.os.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.fh.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")  # as the kernel reports it: no file name

    monkeypatch.setattr(workspace.os, "fdopen", lambda fd, *a, **k: Full(real_fdopen(fd, *a, **k)))
    args = ["reset", "00"] if action == "reset" else ["start"]
    rc, err = _cli(root, *args, capsys=capsys)
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith(f"memlab labs {action}: {root / 'work' / LAB}: No space left on device"), err
    assert "?:" not in err[0] and "free some disk space" in err[0]
    assert not [p for p in (root / "work").iterdir() if p.name.endswith(".tmp")]


def test_argument_errors_exit_2_in_one_line(tmp_path, capsys):
    root = _course(tmp_path)
    for chapter in ("99", "²", "x"):
        rc, err = _cli(root, "reset", chapter, capsys=capsys)
        assert rc == 2 and err == [f"memlab labs reset: chapter={chapter!r} names no lab; allowed: 00"], err


# ----------------------------------------------------------------------------- raced against a real save
class _SlowNbformat:
    """nbformat as jupyter_server's fileio module uses it, with ``write`` cut into chunks and slowed
    down (a big notebook on a slow disk), and optionally interrupted after some chunks."""

    def __init__(self, chunks: int, pause: float, fail_after: int | None) -> None:
        import nbformat

        self._nbformat, self.chunks, self.pause, self.fail_after = nbformat, chunks, pause, fail_after

    def __getattr__(self, name):
        return getattr(self._nbformat, name)

    def write(self, nb, fp, version=None, capture_validation_error=None, **kw):
        text = self._nbformat.writes(nb, version=version if version is not None else self._nbformat.NO_CONVERT)
        text += "\n" if not text.endswith("\n") else ""
        step = -(-len(text) // self.chunks)
        for i in range(0, len(text), step):
            if self.fail_after is not None and i // step == self.fail_after:
                raise KeyboardInterrupt("save interrupted")
            fp.write(text[i:i + step])
            fp.flush()
            time.sleep(self.pause)


def _versions(work: Path) -> list[bytes]:
    """The notebook's bytes and every backup's."""
    found = [p.read_bytes() for p in (work / "backups").glob("*.ipynb")] if (work / "backups").is_dir() else []
    return found + ([(work / LAB).read_bytes()] if (work / LAB).is_file() else [])


@pytest.mark.parametrize("guards", ["on", "off"])
def test_reset_raced_against_jupyter_servers_save_loses_no_version(tmp_path, monkeypatch, guards):
    """20 seeded instants, from before a save to after it, some saves interrupted: after each trial
    the saved version (when the save completed) or the previous one (when it did not) is whole at the
    notebook's path or in backups/. ``off``: the busy checks disabled (a system where they see
    nothing), so the rename and the no-clobber copy alone must keep every version."""
    filemanager = pytest.importorskip("jupyter_server.services.contents.filemanager")
    fileio = pytest.importorskip("jupyter_server.services.contents.fileio")
    import nbformat

    if guards == "off":
        monkeypatch.setattr(workspace, "busy_reason", lambda *a, **k: None, raising=False)
        monkeypatch.setattr(workspace, "open_for_writing", lambda *a, **k: [], raising=False)
    rng = random.Random(41)
    chunks, pause = 24, 0.01
    outcomes = []
    for trial in range(20):
        root = _course(tmp_path / f"t{trial}")
        path = _learner_copy(root, note=f"previous {trial}")
        previous = path.read_bytes()
        saved_nb = nbformat.reads(_edited(root, f"saved {trial}", pad=20_000).decode(), as_version=4)
        saved = (nbformat.writes(saved_nb) + "\n").encode()
        fail_after = rng.randrange(chunks) if rng.random() < 0.3 else None
        monkeypatch.setattr(fileio, "nbformat", _SlowNbformat(chunks, pause, fail_after))
        manager = filemanager.FileContentsManager(root_dir=str(root / "work"))
        box: dict[str, object] = {}

        def save(manager=manager, path=path, nb=saved_nb, box=box):
            try:
                manager._save_notebook(str(path), nb)  # jupyter_server's own save: atomic_writing + nbformat.write
                box["saved"] = True
            except BaseException as exc:  # noqa: BLE001 - the interrupted save (and what its rollback raises)
                box["saved"] = False
                box["error"] = exc

        writer = threading.Thread(target=save)
        delay = rng.uniform(0.0, 1.4 * chunks * pause)
        writer.start()
        time.sleep(delay)
        try:
            labs.reset("00", root)
            outcome = "reset"
        except labs.LabFileError as exc:
            outcome = f"refused: {str(exc)[:60]}"
        writer.join(timeout=60)
        monkeypatch.setattr(fileio, "nbformat", nbformat)
        assert not writer.is_alive()
        versions = _versions(root / "work")
        where = f"trial {trial}: reset at {delay:.3f} s ({outcome}); save {'completed' if box['saved'] else 'interrupted'}"
        if box["saved"]:
            assert saved in versions, f"{where}: the saved version is lost"
        else:
            assert previous in versions, f"{where}: the previous version is lost"
        outcomes.append(f"{outcome} / save {'completed' if box['saved'] else 'interrupted'}")
    print("\n".join(outcomes), file=sys.stderr)


def test_a_folder_in_place_of_the_notebook_is_not_moved(tmp_path, capsys):
    root = _course(tmp_path)
    (root / "work" / LAB).mkdir(parents=True)
    (root / "work" / LAB / "mine.txt").write_text("x")
    rc, err = _cli(root, "reset", "00", capsys=capsys)
    assert rc == 1 and err == [f"memlab labs reset: {root / 'work' / LAB}: is a folder; it must be your notebook "
                               "file (move the folder of that name away)"], err
    assert (root / "work" / LAB / "mine.txt").read_text() == "x" and not (root / "work" / "backups").exists()
