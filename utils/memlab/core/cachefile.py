"""memlab's on-disk caches (the estimate's traces, the planner's stacks and plans) write one way: a pickle into a
temporary file beside the target, then one rename, so a reader never meets half a file and two processes writing
the same entry leave one whole. A cache is only a speed-up: a write that fails (a read-only home, an object that
does not pickle) leaves nothing behind and says nothing."""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

__all__ = ["write_cache_file"]


def write_cache_file(path: Path, obj: Any) -> bool:
    """Pickle ``obj`` to ``path`` atomically (a temporary file in the same folder, then ``os.replace``), making the
    folder if needed; True when it was written, False (and no temporary file left) when anything failed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            pickle.dump(obj, f)
        os.replace(tmp, path)
        return True
    except Exception:  # noqa: BLE001  (read-only home, unpicklable: the cache is only a speed-up)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
