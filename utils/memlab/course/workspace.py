"""The learner's workspace: ``work/`` copies of the labs that are never overwritten, backups on
reset, and file errors that say in one line what to do."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import tempfile
from pathlib import Path
from typing import Any

WORK = "work"
BACKUPS = "backups"


class LabFileError(OSError):
    """A file or folder of the course that ``memlab labs`` cannot use; the message is one line
    naming the path and the fix."""

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


def fix_for_os_error(exc: OSError) -> str:
    """What to do about an OSError on a course file, by its errno, in a few words."""
    import errno

    code = exc.errno
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make it writable (chmod u+w), or work in a copy of the course that you own"
    if code in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return "it must be a folder (move the file of that name away)" if code != errno.EISDIR else \
            "it must be a file (move the folder of that name away)"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free some disk space and run the command again (nothing was half-written)"
    if code == errno.ELOOP:
        return "remove the symbolic link: memlab labs never follows links"
    return "check the path and its permissions"


@contextlib.contextmanager
def lab_file_errors(action: str) -> Any:
    """OSError -> LabFileError with one line: the path, the system's reason and the fix."""
    try:
        yield
    except LabFileError:
        raise
    except OSError as exc:
        if exc.errno is None:  # one of memlab's own messages (no labs/ here, ...)
            raise
        where = exc.filename if exc.filename is not None else "?"
        raise LabFileError(exc.errno, f"{where}: {exc.strerror or exc} during {action}; {fix_for_os_error(exc)}") from None


def refuse_link(path: Path) -> None:
    """LabFileError for a symbolic link (dangling or not) where memlab labs writes or reads your work."""
    if path.is_symlink():
        raise LabFileError(40, f"{path}: is a symbolic link (to {os.readlink(path)!r}); memlab labs never follows "
                               "links out of work/: remove the link (or replace it with your notebook file)")


def _work_dir(root: Path) -> Path:
    work = root / WORK
    refuse_link(work)
    if work.exists() and not work.is_dir():
        raise LabFileError(20, f"{work}: is not a folder; it must be a folder (move the file of that name away)")
    work.mkdir(exist_ok=True)
    return work


def _copy_atomically(src: Path, target: Path) -> None:
    """``target`` becomes a complete copy of ``src`` or stays as it was: a new temp file beside it
    (random name, O_EXCL: a planted file or link there is never written through), fsynced,
    renamed over ``target`` (a rename replaces a link itself, never what it points to), then the
    folder fsynced."""
    data = src.read_bytes()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def is_complete_notebook(path: Path) -> bool:
    """Whether ``path`` is a whole notebook (JSON that nbformat reads, with cells): a copy cut
    short by a full disk or a crash is not, and is not kept as the learner's."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and isinstance(data.get("cells"), list) and isinstance(data.get("nbformat"), int)


def _backup_path(work: Path, stem: str, stamp: str, tag: str = "") -> Path:
    backups = work / BACKUPS
    refuse_link(backups)
    backups.mkdir(exist_ok=True)
    backup = backups / f"{stem}.{tag}{stamp}.ipynb"
    n = 1
    while backup.exists() or backup.is_symlink():
        n += 1
        backup = backups / f"{stem}.{tag}{stamp}-{n}.ipynb"
    return backup


def start(root: str | Path = ".", *, notes: list[str] | None = None) -> tuple[list[Path], list[Path]]:
    """Copy every ``labs/*.ipynb`` of the course's folder ``root`` that ``work/`` lacks into ``work/``;
    never overwrite your work. Returns (copied, kept): the new copies and the learner's notebooks
    left as they were.

    A copy in ``work/`` that is not a complete notebook (cut short by a full disk or a crash) is
    not yours: it is moved to ``work/backups/NN_topic.incomplete-<time>.ipynb`` and replaced by a
    fresh copy (``notes``, a list, gets a line saying so). A symbolic link in ``work/`` is refused,
    never followed; every write is a temp file in the same folder, fsynced, then renamed.
    """
    root = Path(root)
    lab_dir = root / "labs"
    with lab_file_errors("labs start"):
        if lab_dir.exists() and not lab_dir.is_dir():
            raise LabFileError(20, f"{lab_dir}: is not a folder; it must be the course's labs/ folder")
        labs_found = sorted(lab_dir.glob("*.ipynb"))
        if not labs_found:
            raise FileNotFoundError(f"root={str(root)!r} has no labs/*.ipynb: run from the course's root")
        work = _work_dir(root)
        copied, kept = [], []
        for lab in labs_found:
            target = work / lab.name
            refuse_link(target)
            if target.exists():
                if is_complete_notebook(target):
                    kept.append(target)
                    continue
                stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
                backup = _backup_path(work, lab.stem, stamp, "incomplete-")
                os.replace(target, backup)
                if notes is not None:
                    notes.append(f"{target} was not a complete notebook (cut short?): moved to {backup}")
            _copy_atomically(lab, target)
            copied.append(target)
    return copied, kept


def _lab_for(chapter: str, root: Path) -> Path:
    """The lab named by ``chapter``: ``"3"``, ``"03"``, ``"03_mixed_precision"`` or its file name."""
    labs_found = sorted((root / "labs").glob("*.ipynb"))
    key = chapter.strip().removesuffix(".ipynb")
    if key.isdigit():
        key = f"{int(key):02d}"
    matches = [p for p in labs_found if p.stem == key or p.stem.split("_")[0] == key]
    if len(matches) != 1:
        allowed = ", ".join(p.stem.split("_")[0] for p in labs_found) or "none (no labs/*.ipynb)"
        raise ValueError(f"chapter={chapter!r} names no lab; allowed: {allowed}")
    return matches[0]


def _untouched(copy: Path, lab: Path) -> bool:
    """True when the learner's copy has the lab's cells, source for source (outputs, execution counts
    and metadata aside: running a fresh lab writes nothing worth a backup)."""
    def sources(path: Path) -> list[tuple[str, str]] | None:
        try:
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            return [(c["cell_type"], c["source"] if isinstance(c["source"], str) else "".join(c["source"]))
                    for c in cells]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable: keep a backup

    mine = sources(copy)
    return mine is not None and mine == sources(lab)


def reset(chapter: str, root: str | Path = ".", *, now: _dt.datetime | None = None) -> tuple[Path, Path | None]:
    """Give a fresh copy of lab ``chapter`` in ``work/``, after moving the learner's copy to
    ``work/backups/NN_topic.YYYYmmdd-HHMMSS.ipynb`` (no backup of a copy whose cells are still the
    lab's, see :func:`_untouched`). ``chapter``: ``"03"`` or ``"3"``; ``now``: the backup's time
    stamp (default: now). Returns (fresh copy, backup or None); ValueError for a chapter with no lab.
    """
    root = Path(root)
    with lab_file_errors("labs reset"):
        lab = _lab_for(chapter, root)
        work = _work_dir(root)
        target = work / lab.name
        refuse_link(target)
        backup = None
        if target.exists() and not _untouched(target, lab):
            stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
            backup = _backup_path(work, lab.stem, stamp)
            _copy_atomically(target, backup)
        _copy_atomically(lab, target)
    return target, backup


def default_notebooks(root: str | Path = ".") -> tuple[Path, list[Path]]:
    """What ``memlab grade`` grades when given no path: ``work/*.ipynb`` when ``work/`` exists,
    else ``labs/*.ipynb``. Returns (folder, notebooks).
    """
    root = Path(root)
    folder = root / WORK if (root / WORK).is_dir() else root / "labs"
    return folder, sorted(folder.glob("*.ipynb"))
