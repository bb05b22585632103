"""A real headless Chromium (Debian's ``chromium``) to render a page: its DOM after the
scripts ran, or a screenshot. Used to check that the report's front page draws its charts.

Each call gets a fresh, empty profile directory and every background service off, so nothing
is fetched or remembered; ``--virtual-time-budget`` lets the page's scripts finish first.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = "chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
SCRIPT_BUDGET_MS = 10_000
TIMEOUT_S = 120


class BrowserError(RuntimeError):
    """Chromium is missing or failed on a page."""


def _run(page: str | Path, *args: str) -> str:
    binary = shutil.which(CHROMIUM)
    if binary is None:
        raise BrowserError(f"{CHROMIUM} not found: apt-get install -y chromium")
    url = Path(page).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="servematrix-chromium-") as profile:
        command = [binary, *FLAGS, f"--user-data-dir={profile}"]
        command += [f"--virtual-time-budget={SCRIPT_BUDGET_MS}", *args, url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise BrowserError(f"{CHROMIUM} failed on {page}: {done.stderr.strip()[-500:]}")
    return done.stdout


def rendered_dom(page: str | Path) -> str:
    """The page's DOM after its scripts ran."""
    return _run(page, "--dump-dom")


def screenshot(page: str | Path, png: str | Path, width: int = 1400, height: int = 2400) -> Path:
    """A PNG of the page's top ``width`` × ``height`` pixels."""
    png = Path(png).resolve()
    _run(page, f"--window-size={width},{height}", f"--screenshot={png}")
    if not png.is_file() or png.stat().st_size == 0:
        raise BrowserError(f"{CHROMIUM} wrote no screenshot of {page}")
    return png
