"""Headless Chromium for the dashboard's browser tests: Debian's ``chromium`` and
``chromium-driver``, installed when missing (as PostgreSQL is), never a browser download."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from outbox.devstack.procs import StackError, apt_install

PACKAGES = ("chromium", "chromium-driver")

#: Chromium's flags for a test: no sandbox (root in a container), no GPU, and nothing that
#: reaches out to the network on its own (the machine's network is closed).
HEADLESS_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


@dataclass(frozen=True)
class Chromium:
    browser: Path
    driver: Path


def chromium() -> Chromium:
    """Debian's Chromium and its chromedriver; installs both when either is missing."""
    found = _find()
    if found is None:
        apt_install(*PACKAGES)
        found = _find()
    if found is None:
        raise StackError(
            "chromium or chromedriver not found after installing " + " ".join(PACKAGES)
        )
    return found


def _find() -> Chromium | None:
    browser = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return None
    return Chromium(Path(browser), Path(driver))
