"""Render memlab's interactive memory timeline in headless Chromium and save a screenshot.

    python tools/timeline_screenshot.py                 # writes docs/timeline.html and docs/timeline.png
    python tools/timeline_screenshot.py --out /tmp/x    # somewhere else

The page is one TinyGPT training step with AdamW (2 steps, so the optimizer state is there),
recorded by ``memlab.profiler.timeline.Timeline`` on the CPU, written by ``Timeline.save_html`` (a
self-contained page: inline JavaScript, no network) and opened with ``#hover=peak``, which makes
the page show the tooltip of the largest tensor alive at the peak, as a mouse hover would.
Chromium runs with --dump-dom first to check that the script ran (the tooltip holds the tensor's
name), then takes the screenshot. Needs ``chromium`` (Debian: ``apt-get install chromium``) or
``google-chrome`` on PATH, or ``CHROMIUM=/path/to/chrome``. Exit code 2 when there is none.

    python tools/timeline_screenshot.py --jupyterlab    # writes docs/timeline_jupyterlab.png

The same timeline inside JupyterLab: a notebook in a temporary folder whose cell records the
step and calls ``tl.show()`` is executed with nbclient and signed (trusted: JupyterLab runs the
inline script of trusted outputs only, and the signature database lives in the temporary
JUPYTER_DATA_DIR), a JupyterLab server is started on a free port with a random token and that
folder as its root, and Chromium, driven over the DevTools protocol, opens the notebook, waits
until JupyterLab has rendered the output's canvas, legend and tooltip, and saves a screenshot of
the 1400 x 1000 window. The server (and its kernel) is killed on every way out, Ctrl-C included.
Needs ``jupyterlab``, ``nbclient`` and ``tornado`` (its WebSocket client); exit code 2 without.
"""
from __future__ import annotations

import argparse
import html as html_lib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    env = os.environ.get("CHROMIUM")
    if env:
        return env if Path(env).exists() or shutil.which(env) else None
    return next((b for b in map(shutil.which, BROWSERS) if b), None)


def record(html: Path) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "utils"))
    from memlab.models import TinyGPT, TinyGPTConfig
    from memlab.profiler.timeline import Timeline

    torch.manual_seed(0)
    cfg = TinyGPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=64)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (4, 64))
    y = torch.randint(0, cfg.vocab_size, (4, 64))
    with Timeline(model, opt) as tl:
        for _ in range(2):
            loss = model(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert tl.peak_bytes == tl.tracker.peak_bytes, (tl.peak_bytes, tl.tracker.peak_bytes)
    tl.save_html(html, title="TinyGPT (2 layers x 64), batch 4 x 64, two AdamW steps: every tensor storage in time",
                 width=900, height=380)
    return {"peak": tl.peak_bytes, "ops": tl.ops, "storages": len(tl.allocations)}


def _browser_args(browser: str, profile: str) -> list[str]:
    args = [browser, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
            "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=3000"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
    return args


def shoot(browser: str, html: Path, png: Path, timeout: float = 120) -> str:
    """Check the page's script ran (--dump-dom), then screenshot it. Returns the tooltip's text."""
    url = html.resolve().as_uri() + "#hover=peak"
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([*_browser_args(browser, profile), "--dump-dom", url], capture_output=True,
                             text=True, timeout=timeout)
        if dom.returncode != 0:
            raise RuntimeError(f"{browser} --dump-dom failed ({dom.returncode}): {dom.stderr.strip()[-500:]}")
        m = re.search(r'class="tip"[^>]*display: block[^>]*>(.*?)</div>', dom.stdout, re.S)
        if m is None:
            raise RuntimeError("the page's script did not run in the browser: no tooltip in the rendered DOM")
        tip = html_lib.unescape(re.sub(r"<[^>]+>", " ", m.group(1)))
        shot = subprocess.run([*_browser_args(browser, profile), f"--screenshot={png.resolve()}",
                               "--window-size=940,470", url], capture_output=True, text=True, timeout=timeout)
        if shot.returncode != 0 or not png.exists():
            raise RuntimeError(f"{browser} --screenshot failed ({shot.returncode}): {shot.stderr.strip()[-500:]}")
    return " ".join(tip.split())


NOTEBOOK_CELL = """\
import torch
from memlab.models import TinyGPT, TinyGPTConfig
from memlab.profiler.timeline import Timeline

torch.manual_seed(0)
cfg = TinyGPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=64)
model = TinyGPT(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randint(0, cfg.vocab_size, (2, 4, 64))
with Timeline(model, opt) as tl:       # two AdamW steps: the optimizer state is there
    for _ in range(2):
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
tl.show(title="TinyGPT (2 layers x 64), batch 4 x 64, two AdamW steps", width=900, height=380)"""

# True once the output's script drew the legend and (with #hover=peak) the tooltip
_RENDERED_JS = """(() => {
  const out = document.querySelector('.jp-OutputArea-output canvas');
  if (!out) return null;
  const root = out.parentElement, tip = root.querySelector('.tip'), legend = root.querySelector('.legend');
  const notebook = document.querySelector('.jp-Notebook') !== null;
  return JSON.stringify({legend: legend ? [...legend.childNodes].map(n => n.textContent.trim()).filter(Boolean).join(', ') : '', tip: tip && tip.style.display === 'block' ?
                         tip.innerText : '', notebook: notebook});
})()"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_notebook(folder: Path, data_dir: Path, env: dict) -> Path:
    """Write, execute (nbclient, in ``folder``) and sign the notebook; returns its path."""
    import nbformat
    from nbclient import NotebookClient
    from nbformat.sign import NotebookNotary

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("## memlab.profiler.timeline in JupyterLab\nHover a band to name its tensor."),
                nbformat.v4.new_code_cell(NOTEBOOK_CELL)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits PYTHONPATH (this checkout's memlab) and the thread count
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    html = [o for o in nb.cells[1].outputs if "text/html" in o.get("data", {})]
    if len(html) != 1 or "<canvas" not in html[0]["data"]["text/html"]:
        raise RuntimeError(f"the notebook's cell did not display the timeline: outputs {nb.cells[1].outputs!r:.500}")
    NotebookNotary(data_dir=str(data_dir)).sign(nb)  # trusted: JupyterLab runs the output's inline script
    path = folder / "timeline.ipynb"
    nbformat.write(nb, str(path))
    return path


def _stop(proc: subprocess.Popen | None) -> None:
    """Terminate a process started in its own session, and everything it started (the kernel)."""
    if proc is None or proc.poll() is not None:
        return
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    import time
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited ({proc.returncode}): {log.read_text(errors='replace')[-800:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"jupyter lab did not answer {url.split('?')[0]} within {timeout:.0f} s")


async def _cdp_screenshot(ws_url: str, page_url: str, png: Path, timeout: float) -> dict:
    """Open ``page_url`` in the DevTools target ``ws_url``, wait for the rendered timeline, save a PNG."""
    import asyncio
    import base64
    import json
    import time

    from tornado.websocket import websocket_connect

    conn = await websocket_connect(ws_url, max_message_size=256 * 2**20)
    counter = 0

    async def call(method: str, **params):
        nonlocal counter
        counter += 1
        my_id = counter
        await conn.write_message(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = await asyncio.wait_for(conn.read_message(), timeout)
            if msg is None:
                raise RuntimeError("Chromium closed the DevTools connection")
            data = json.loads(msg)
            if data.get("id") == my_id:
                if "error" in data:
                    raise RuntimeError(f"DevTools {method}: {data['error']}")
                return data.get("result", {})

    try:
        await call("Emulation.setDeviceMetricsOverride", width=1400, height=1000, deviceScaleFactor=1, mobile=False)
        await call("Page.enable")
        await call("Page.navigate", url=page_url)
        t0, state = time.monotonic(), None
        while time.monotonic() - t0 < timeout:
            r = await call("Runtime.evaluate", expression=_RENDERED_JS, returnByValue=True)
            value = r.get("result", {}).get("value")
            state = json.loads(value) if value else None
            if state and state["legend"] and state["tip"] and state["notebook"]:
                break
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"JupyterLab did not render the timeline's output within {timeout:.0f} s "
                               f"(last state: {state}); is the notebook trusted?")
        await asyncio.sleep(3)  # let the kernel-status and toolbar settle
        shot = await call("Page.captureScreenshot", format="png")
        png.write_bytes(base64.b64decode(shot["data"]))
        return {"tip": " ".join(state["tip"].split()), "legend": " ".join(state["legend"].split()),
                "seconds": time.monotonic() - t0}
    finally:
        conn.close()


def shoot_jupyterlab(browser: str, png: Path, timeout: float = 120) -> dict:
    """The timeline as a JupyterLab notebook output, screenshotted; returns what was rendered."""
    import asyncio
    import json
    import secrets
    import signal
    import threading
    import time
    import urllib.request

    jupyter = Path(sys.executable).with_name("jupyter")
    jupyter_cmd = [str(jupyter)] if jupyter.exists() else [sys.executable, "-m", "jupyter"]
    with tempfile.TemporaryDirectory(prefix="memlab-jlab-") as tmp:
        tmp = Path(tmp)
        folder, data_dir = tmp / "notebooks", tmp / "data"
        for d in (folder, data_dir, tmp / "config", tmp / "runtime", tmp / "settings", tmp / "workspaces", tmp / "chrome"):
            d.mkdir()
        # no news toast, no "announcements" pop-up over the notebook
        news = tmp / "settings" / "@jupyterlab" / "apputils-extension"
        news.mkdir(parents=True)
        (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                            "checkForUpdates": False}))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "utils"), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "JUPYTER_DATA_DIR": str(data_dir), "JUPYTER_CONFIG_DIR": str(tmp / "config"),
               "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
        nb = make_notebook(folder, data_dir, env)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (timeout, CI cancel) unwinds like Ctrl-C, so the finally block stops the server; set
            # here because executing the notebook (jupyter_client) puts SIGTERM back to its default
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        port, token = _free_port(), secrets.token_hex(16)
        log = tmp / "jupyter.log"
        server = chrome = None
        try:
            with open(log, "wb") as fh:
                server = subprocess.Popen(
                    [*jupyter_cmd, "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                     f"--ServerApp.token={token}", f"--ServerApp.root_dir={folder}", "--ServerApp.open_browser=False",
                     f"--LabApp.user_settings_dir={tmp / 'settings'}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
                     *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
                    env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            base = f"http://127.0.0.1:{port}"
            _wait_for_server(f"{base}/api/status?token={token}", server, log)
            chrome = subprocess.Popen(
                [*[a for a in _browser_args(browser, str(tmp / "chrome")) if not a.startswith("--virtual-time")],
                 "--remote-debugging-port=0", "--window-size=1400,1000", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            active = tmp / "chrome" / "DevToolsActivePort"
            t0 = time.monotonic()
            while not active.exists() or not active.read_text().strip():
                if chrome.poll() is not None or time.monotonic() - t0 > 60:
                    raise RuntimeError(f"{browser} did not open its DevTools port")
                time.sleep(0.2)
            dev_port = active.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{dev_port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if not pages:
                raise RuntimeError(f"{browser} has no page to drive")
            url = f"{base}/lab/tree/{nb.name}?token={token}&reset#hover=peak"
            facts = asyncio.run(_cdp_screenshot(pages[0]["webSocketDebuggerUrl"], url, png, timeout))
        finally:
            _stop(chrome)
            if server is not None and server.poll() is None:
                try:  # the server's own shutdown stops its kernel too (the kernel runs in its own session)
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/shutdown", method="POST",
                                                 headers={"Authorization": f"token {token}"})
                    urllib.request.urlopen(req, timeout=5).close()
                    server.wait(timeout=20)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            _stop(server)
        if server is not None:
            facts["server"] = f"JupyterLab server (pid {server.pid}, root {tmp}) stopped"
        return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="screenshot memlab's memory timeline in headless Chromium")
    ap.add_argument("--out", default=str(ROOT / "docs"), help="folder for timeline.html and timeline.png (default: docs/)")
    ap.add_argument("--jupyterlab", action="store_true",
                    help="instead: the timeline as a notebook output in a JupyterLab server -> timeline_jupyterlab.png")
    args = ap.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print("timeline_screenshot: no Chromium found (apt-get install chromium, or CHROMIUM=/path/to/chrome)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.jupyterlab:
        import importlib.util

        missing = [m for m in ("jupyterlab", "nbclient", "nbformat", "tornado") if importlib.util.find_spec(m) is None]
        if missing:
            print(f"timeline_screenshot --jupyterlab needs {', '.join(missing)}: pip install jupyterlab nbclient",
                  file=sys.stderr)
            return 2
        png = out / "timeline_jupyterlab.png"
        facts = shoot_jupyterlab(browser, png)
        print(f"wrote {png}: JupyterLab rendered the notebook output in {facts['seconds']:.1f} s; "
              f"legend: {facts['legend']}; hover: {facts['tip']}; {facts['server']}")
        return 0
    html, png = out / "timeline.html", out / "timeline.png"
    facts = record(html)
    tip = shoot(browser, html, png)
    print(f"wrote {html} and {png}: peak {facts['peak']:,} B over {facts['ops']} ops, {facts['storages']} storages; "
          f"hover: {tip}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
