"""Render memlab's interactive memory timeline in headless Chromium and save a screenshot.

    python tools/timeline_screenshot.py                 # writes docs/timeline.html and docs/timeline.png
    python tools/timeline_screenshot.py --out /tmp/x    # somewhere else

The page is one TinyGPT training step with AdamW (2 steps, so the optimizer state is there),
recorded by ``memlab.timeline.Timeline`` on the CPU, written by ``Timeline.save_html`` (a
self-contained page: inline JavaScript, no network) and opened with ``#hover=peak``, which makes
the page show the tooltip of the largest tensor alive at the peak, as a mouse hover would.
Chromium runs with --dump-dom first to check that the script ran (the tooltip holds the tensor's
name), then takes the screenshot. Needs ``chromium`` (Debian: ``apt-get install chromium``) or
``google-chrome`` on PATH, or ``CHROMIUM=/path/to/chrome``. Exit code 2 when there is none.
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
    from memlab.timeline import Timeline

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="screenshot memlab's memory timeline in headless Chromium")
    ap.add_argument("--out", default=str(ROOT / "docs"), help="folder for timeline.html and timeline.png (default: docs/)")
    args = ap.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print("timeline_screenshot: no Chromium found (apt-get install chromium, or CHROMIUM=/path/to/chrome)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    html, png = out / "timeline.html", out / "timeline.png"
    facts = record(html)
    tip = shoot(browser, html, png)
    print(f"wrote {html} and {png}: peak {facts['peak']:,} B over {facts['ops']} ops, {facts['storages']} storages; "
          f"hover: {tip}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
