"""Headless Chromium for the browser tests: Debian's ``chromium`` driven by Playwright.

Playwright's own browser download is not used (it needs the internet at test time);
Playwright drives the system Chromium through ``executable_path``. Where Chromium is
missing and the tests run as root on a Debian/Ubuntu machine (a CI container),
:func:`chromium_path` installs Debian's package once (``apt-get install chromium``, a
few minutes); otherwise the browser tests are skipped with the command to run.

The tests write their screenshots under a temporary directory. The README's pictures in
``docs/screenshots/`` are refreshed only on purpose::

    python -m tests.browser --refresh-docs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS_SCREENSHOTS = REPO / "docs" / "screenshots"
# Set (to "1") only by ``--refresh-docs``: then the tests write into DOCS_SCREENSHOTS.
REFRESH_ENV = "MEGALITH_REFRESH_SCREENSHOTS"
# Flags for a sandboxless container with no network beyond loopback (without the
# background-networking ones Chromium keeps dialling Google's hosts).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]


@cache
def chromium_path() -> str | None:
    """The system Chromium, installed first when that is possible here; None if not."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found or os.environ.get("MEGALITH_NO_BROWSER_INSTALL"):
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], INSTALL):
        try:
            subprocess.run(command, env=env, capture_output=True, timeout=900, check=True)
        except (subprocess.SubprocessError, OSError):
            if command is INSTALL:
                return None
    return shutil.which("chromium")


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 900) -> Iterator:
    """A Playwright page in headless Chromium (skips the test when there is none)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium here: apt-get install chromium (Debian) to run the UI tests")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()


def screenshot_dir(scratch: Path) -> Path:
    """Where the browser tests save screenshots: ``scratch`` unless refreshing the docs."""
    return DOCS_SCREENSHOTS if os.environ.get(REFRESH_ENV) == "1" else scratch


def refresh_docs() -> int:
    """Run the browser tests so that they overwrite the README's screenshots."""
    env = {**os.environ, REFRESH_ENV: "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/test_browser_ui.py"]  # fmt: skip
    return subprocess.run(command, env=env, cwd=REPO, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.browser", description=__doc__)
    parser.add_argument("--refresh-docs", action="store_true",
                        help=f"rerun tests/test_browser_ui.py writing into {DOCS_SCREENSHOTS}")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.refresh_docs:
        parser.print_help()
        return 2
    return refresh_docs()


if __name__ == "__main__":
    sys.exit(main())
