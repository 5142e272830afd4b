"""The learner's workspace: ``work/`` copies of the labs that are never overwritten, backups on
reset, a record of what was copied (``memlab grade`` skips the labs unchanged since), and file
errors that say in one line what to do.

A reset never loses a save: the learner's file moves into ``backups/`` with one rename (a program
still writing to it writes into the backup), the fresh copy never replaces a file that appeared
meanwhile, and the reset is refused while the file looks busy: JupyterLab's save in progress (its
``.~NAME`` copy beside the file: jupyter_server's ``atomic_writing`` copies the previous version
there, then rewrites the file in place), a change in the last :data:`RECENT_SECONDS`, or (Linux,
best effort) a process holding it open for writing. The last check sees only the processes
``/proc`` shows this user, and none on other systems; a save that starts after the checks writes
into the moved file or into the path, never into nothing.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import errno as _errno
import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

WORK = "work"
BACKUPS = "backups"
#: the record of the copies ``labs start`` / ``reset`` made (in work/): name -> digest of its cells' sources
COPIES = ".memlab-copies.json"
#: a file changed less than this many seconds ago is not reset (a save may be under way)
RECENT_SECONDS = 5.0


class LabFileError(OSError):
    """A file or folder of the course that ``memlab labs`` cannot use; the message is one line
    naming the path and the fix."""

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


class LabArgumentError(ValueError):
    """A bad argument to ``memlab labs`` (a chapter with no lab): the command exits 2."""


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
def lab_file_errors(action: str, path: str | os.PathLike | None = None) -> Any:
    """OSError -> LabFileError with one line: the path (the error's own, else ``path``), the
    system's reason and the fix."""
    try:
        yield
    except LabFileError:
        raise
    except OSError as exc:
        if exc.errno is None:  # one of memlab's own messages (no labs/ here, ...)
            raise
        where = exc.filename if exc.filename is not None else (path if path is not None else ".")
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
    tmp = _temp_copy(src, target)
    try:
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise _named(exc, target)
    _sync_folder(target.parent)


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` when it names no file (a write's ENOSPC names none)."""
    if exc.filename is None:
        exc.filename = str(path)
    return exc


def _temp_copy(src: Path, target: Path) -> str:
    """A complete copy of ``src`` in a new temp file beside ``target`` (random name, O_EXCL),
    fsynced; its path. Nothing is left behind when it fails."""
    data = src.read_bytes()
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise _named(exc, target.parent) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _named(exc, target) from None
        raise
    return tmp


def _sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _place_new(src: Path, target: Path) -> None:
    """``target`` becomes a complete copy of ``src``, only if no file of that name exists when it
    is placed (a hard link of a finished temp file: a save that recreated ``target`` meanwhile is
    kept); LabFileError(EEXIST) otherwise. Where the file system has no hard links, a rename,
    still only when ``target`` is absent."""
    tmp = _temp_copy(src, target)
    try:
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise LabFileError(_errno.EEXIST, f"{target}: was written again while being reset (a save?): kept as "
                                              "it is; run the reset again to replace it") from None
        except OSError as exc:
            if exc.errno not in (_errno.EPERM, _errno.ENOTSUP, _errno.EOPNOTSUPP, _errno.EXDEV, _errno.EMLINK):
                raise _named(exc, target) from None
            if os.path.lexists(target):
                raise LabFileError(_errno.EEXIST, f"{target}: was written again while being reset (a save?): "
                                                  "kept as it is; run the reset again to replace it") from None
            os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _sync_folder(target.parent)


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
    fresh copy (``notes``, a list, gets a line saying so), unless it may be a save under way
    (:func:`busy_reason`: left as it is, with a note). A symbolic link in ``work/`` is refused,
    never followed; every write is a temp file in the same folder, fsynced, then renamed.
    """
    root = Path(root)
    lab_dir = root / "labs"
    with lab_file_errors("labs start", root / WORK):
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
                why = busy_reason(target)
                if why:  # half written because a save is under way: not cut short, left to finish
                    kept.append(target)
                    if notes is not None:
                        notes.append(f"{target} is not a complete notebook yet: {why}; left as it is")
                    continue
                stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
                backup = _backup_path(work, lab.stem, stamp, "incomplete-")
                os.replace(target, backup)
                if notes is not None:
                    notes.append(f"{target} was not a complete notebook (cut short?): moved to {backup}")
            _copy_atomically(lab, target)
            copied.append(target)
        _record_copies(work, copied)
    return copied, kept


def _lab_for(chapter: str, root: Path) -> Path:
    """The lab named by ``chapter``: ``"3"``, ``"03"``, ``"03_mixed_precision"`` or its file name;
    :class:`LabArgumentError` listing the chapters there are otherwise."""
    labs_found = sorted((root / "labs").glob("*.ipynb"))
    key = str(chapter).strip().removesuffix(".ipynb")
    if re.fullmatch(r"[0-9]{1,6}", key):
        key = f"{int(key):02d}"
    matches = [p for p in labs_found if p.stem == key or p.stem.split("_")[0] == key]
    if len(matches) != 1:
        allowed = ", ".join(p.stem.split("_")[0] for p in labs_found) or "none (no labs/*.ipynb)"
        raise LabArgumentError(f"chapter={chapter!r} names no lab; allowed: {allowed}")
    return matches[0]


def _sources(path: Path) -> list[tuple[str, str]] | None:
    """The notebook's cells as (type, source) pairs; None when it is not a readable notebook."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return [(c["cell_type"], c["source"] if isinstance(c["source"], str) else "".join(c["source"]))
                for c in cells]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def _untouched(copy: Path, lab: Path) -> bool:
    """True when the learner's copy has the lab's cells, source for source (outputs, execution counts
    and metadata aside: running a fresh lab writes nothing worth a backup)."""
    mine = _sources(copy)
    return mine is not None and mine == _sources(lab)


def sources_digest(path: Path) -> str | None:
    """SHA-256 of a notebook's cell types and sources (outputs and metadata aside); None when unreadable."""
    cells = _sources(path)
    if cells is None:
        return None
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode("utf-8")).hexdigest()


def _read_copies(work: Path) -> dict[str, str]:
    try:
        data = json.loads((work / COPIES).read_text(encoding="utf-8"))
        return {k: v for k, v in data.get("copies", {}).items() if isinstance(k, str) and isinstance(v, str)}
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}  # absent or damaged: every copy counts as changed (graded)


def _record_copies(work: Path, copies: list[Path]) -> None:
    """Add the digests of ``copies`` (just copied into ``work``) to work/.memlab-copies.json,
    best effort (without it ``memlab grade`` compares with labs/ or grades the notebook)."""
    if not copies:
        return
    record = _read_copies(work)
    for path in copies:
        digest = sources_digest(path)
        if digest is not None:
            record[path.name] = digest
    text = json.dumps({"about": "what `memlab labs start/reset` copied: cell sources' sha256", "copies": record},
                      indent=1, sort_keys=True)
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=work, prefix=f"{COPIES}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
            os.replace(tmp, work / COPIES)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def unchanged_since_copy(notebook: str | os.PathLike, root: str | Path = ".") -> bool:
    """Whether ``work/NN_topic.ipynb`` still has the cells it had when ``memlab labs start`` or
    ``reset`` copied it (its digest in work/.memlab-copies.json), or the cells of the lab now in
    ``labs/``: nothing of the learner's to grade. False when unreadable or unknown."""
    path, root = Path(notebook), Path(root)
    digest = sources_digest(path)
    if digest is None:
        return False
    if _read_copies(path.parent).get(path.name) == digest:
        return True
    lab = root / "labs" / path.name
    return lab.is_file() and _untouched(path, lab)


def jupyter_temp(path: Path) -> Path:
    """The copy of the previous version JupyterLab keeps beside a notebook while saving it:
    ``.~NAME`` (jupyter_server's ``fileio.path_to_intermediate``), removed when the save ends."""
    return path.with_name(".~" + path.name)


def open_for_writing(path: Path) -> list[str]:
    """The processes (``"PID (name)"``) that hold ``path`` open for writing, as Linux's /proc shows
    them to this user; [] where there is no /proc. Best effort: other users' processes are not seen."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return []
    try:
        st = os.stat(path)
    except OSError:
        return []
    want, found = str(Path(os.path.realpath(path))), []
    for pid in (p for p in os.listdir(proc) if p.isdigit()):
        try:
            fds = os.listdir(proc / pid / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(proc / pid / "fd" / fd)
                if link != want and not link.startswith(want + " ("):
                    continue
                fst = os.stat(proc / pid / "fd" / fd)
                if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                    continue
                info = (proc / pid / "fdinfo" / fd).read_text()
                flags = int(re.search(r"^flags:\s*([0-7]+)", info, re.M).group(1), 8)  # type: ignore[union-attr]
            except (OSError, AttributeError, ValueError):
                continue
            if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
                try:
                    name = (proc / pid / "comm").read_text().strip()
                except OSError:
                    name = "?"
                found.append(f"{pid} ({name})")
                break
    return found


def busy_reason(path: Path, *, recent: bool = True, now: float | None = None) -> str | None:
    """Why ``path`` must not be moved now (a save may be under way), or None. ``recent``: also when
    it changed in the last :data:`RECENT_SECONDS` (``now``: the time to count from)."""
    temp = jupyter_temp(path)
    if os.path.lexists(temp):
        return (f"JupyterLab is saving it ({temp} exists); wait for the save to end. If no JupyterLab runs, "
                f"{temp.name} is the version before a save that failed: keep or delete it, then reset again")
    writers = open_for_writing(path)
    if writers:
        return (f"open for writing by process {', '.join(writers)}; close it (in JupyterLab: save, then "
                "File > Close and Shut Down Notebook) and reset again")
    if not recent:
        return None
    try:
        age = (time.time() if now is None else now) - os.stat(path).st_mtime
    except OSError:
        return None
    if abs(age) < RECENT_SECONDS:
        return (f"changed {max(age, 0.0):.1f} s ago (a save may be under way); wait {RECENT_SECONDS:g} s "
                "and reset again")
    return None


def reset(chapter: str, root: str | Path = ".", *, now: _dt.datetime | None = None) -> tuple[Path, Path | None]:
    """Give a fresh copy of lab ``chapter`` in ``work/``, after moving the learner's copy to
    ``work/backups/NN_topic.YYYYmmdd-HHMMSS.ipynb`` with one rename (no backup of a copy whose
    cells are still the lab's, see :func:`_untouched`). ``chapter``: ``"03"`` or ``"3"``; ``now``:
    the backup's time stamp (default: now). Returns (fresh copy, backup or None).

    Raises:
        LabArgumentError: for a chapter with no lab.
        LabFileError: when the copy is busy (:func:`busy_reason`: nothing is changed), when a file
            appears at its name while resetting (kept), or for an OS error (naming the path).
    """
    root = Path(root)
    with lab_file_errors("labs reset", root / WORK):
        lab = _lab_for(chapter, root)
        work = _work_dir(root)
        target = work / lab.name
        refuse_link(target)
        backup = None
        if target.is_dir():
            raise LabFileError(_errno.EISDIR, f"{target}: is a folder; it must be your notebook file "
                                              "(move the folder of that name away)")
        if os.path.lexists(target):
            # a copy still as given may be new (just copied): only a changed one must be older than a few seconds
            why = busy_reason(target, recent=not _untouched(target, lab))
            if why:
                raise LabFileError(_errno.EBUSY, f"{target}: {why}; nothing was changed")
            stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
            had_backups = os.path.lexists(work / BACKUPS)
            backup = _backup_path(work, lab.stem, stamp)
            # the one rename: the learner's file moves as it is, with a writer still holding it
            os.replace(target, backup)
            if _untouched(backup, lab) and not open_for_writing(backup):
                os.unlink(backup)  # the lab as given: nothing worth a backup
                backup = None
                if not had_backups:
                    with contextlib.suppress(OSError):
                        (work / BACKUPS).rmdir()
        try:
            _place_new(lab, target)
        except LabFileError as exc:
            if backup is not None:
                raise LabFileError(exc.errno, f"{exc}; your copy before it is {backup}") from None
            raise
        _record_copies(work, [target])
    return target, backup


def default_notebooks(root: str | Path = ".") -> tuple[Path, list[Path]]:
    """What ``memlab grade`` grades when given no path: ``work/*.ipynb`` when ``work/`` exists,
    else ``labs/*.ipynb``. Returns (folder, notebooks).
    """
    root = Path(root)
    folder = root / WORK if (root / WORK).is_dir() else root / "labs"
    return folder, sorted(folder.glob("*.ipynb"))
