"""``make lab`` as a learner meets it, in a pseudo-terminal: the one URL it prints opens the start page with
the file browser at the repository root, opening a notebook and its kernel prints none of Jupyter's noise,
and one Ctrl-C (SIGINT to the terminal's process group) ends it with one line, not make's "Interrupt".

A real JupyterLab server (about 20 s on 2 cores). What the browser then draws is not checked here: the
``?file-browser-path=/`` query is JupyterLab's documented way to keep the browser at the root
(https://jupyterlab.readthedocs.io/en/stable/user/urls.html), and the page served for the URL is checked to
carry the start page as its tree path.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import select
import shutil
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")
NOTEBOOK = "notebooks/00_where_the_memory_goes.ipynb"

pytestmark = pytest.mark.skipif(MAKE is None or sys.platform != "linux", reason="needs GNU make and a Linux pty")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Terminal:
    """``make lab`` in a pseudo-terminal; ``read`` collects what the terminal shows."""

    def __init__(self, stamp: Path, port: int):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: make, as a session leader on the pty (Ctrl-C reaches its whole group)
            os.chdir(ROOT)
            # a learner types make lab in a shell: no outer make's level or flags (under make test, MAKELEVEL=1
            # makes this make print "make[1]: Entering directory", which a learner never sees)
            for name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "MAKE_TERMOUT", "MAKE_TERMERR"):
                os.environ.pop(name, None)
            os.environ["JUPYTER_PORT"] = str(port)
            os.environ["BROWSER"] = "true"  # no browser is opened (it would find none anyway)
            os.execvp(MAKE, [MAKE, "lab", f"STAMP={stamp}"])
        self.out = b""

    def read(self, seconds: float, until: bytes | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and until in self.out):
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:
                    return
                if not data:
                    return
                self.out += data

    def text(self) -> str:
        return self.out.decode(errors="replace").replace("\r\n", "\n")

    def close(self) -> int | None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            return os.waitpid(self.pid, 0)[1]
        except ChildProcessError:
            return None


def _open_notebook(base: str, token: str) -> None:
    """What a browser does on opening a lecture: read it, start its session and connect to the kernel."""
    from tornado.websocket import websocket_connect

    headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}
    urllib.request.urlopen(urllib.request.Request(f"{base}/api/contents/{NOTEBOOK}?content=1", headers=headers),
                           timeout=30).read()
    body = json.dumps({"path": NOTEBOOK, "type": "notebook", "name": "", "kernel": {"name": "python3"}}).encode()
    session = json.load(urllib.request.urlopen(urllib.request.Request(
        f"{base}/api/sessions", method="POST", headers=headers, data=body), timeout=60))

    async def connect() -> None:
        ws = await websocket_connect(base.replace("http", "ws", 1) + f"/api/kernels/{session['kernel']['id']}"
                                     f"/channels?token={token}&session_id=test-make-lab")
        await asyncio.sleep(4)  # the kernel starts and logs what it logs
        ws.close()

    asyncio.run(connect())


def test_make_lab_opens_the_start_page_at_the_root_quietly_and_stops_cleanly(tmp_path):
    stamp = tmp_path / "stamp"
    stamp.touch()  # set-up done: no pip install
    term = _Terminal(stamp, _free_port())
    try:
        term.read(120, until=b"token=")
        term.read(1)
        urls = re.findall(r"http://\S+", term.text())
        assert len(urls) == 1, term.text()
        url = urls[0]
        # the start page, the file browser kept at the root, the token after the URL's own query (not "?token=")
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/lab/tree/docs/start\.md\?file-browser-path=/&token=\w+", url), url
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert '"treePath": "docs/start.md"' in page
        base, token = url.split("/lab/", 1)[0], url.rsplit("token=", 1)[1]
        _open_notebook(base, token)
        term.read(3)
        os.killpg(term.pid, signal.SIGINT)  # Ctrl-C
        term.read(60)
        _, status = os.waitpid(term.pid, 0)
    finally:
        term.close()
    lines = [ln for ln in term.text().splitlines() if ln.strip()]
    assert lines[0].startswith("JupyterLab (Ctrl-C to stop): http://"), lines
    noise = [ln for ln in lines[1:] if ln not in ("Shutting down...",) and not ln.startswith("JupyterLab stopped.")]
    assert noise == [], noise  # no "not trusted", no kernel TCP note, no websocket ping note
    assert lines[-1].startswith("JupyterLab stopped."), lines
    assert "Interrupt" not in term.text() and "Error" not in term.text()
    assert not os.WIFEXITED(status) or os.WEXITSTATUS(status) == 0
