"""Debian's Chromium, headless, driven by Selenium through Debian's ``chromedriver``:
the real browser the operator's page is tested and photographed in.

Nothing is downloaded: the browser and its driver are the apt packages ``chromium`` and
``chromium-driver`` (``.ci/run`` installs them), and Selenium is told where both are,
so its own driver manager never runs.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

__all__ = ["chromium_missing", "open_chromium"]


def _paths() -> tuple[str | None, str | None]:
    return shutil.which("chromium"), shutil.which("chromedriver")


def chromium_missing() -> str | None:
    """Why the browser cannot be run here (None: it can)."""
    browser, driver = _paths()
    if browser is None or driver is None:
        return "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


@contextmanager
def open_chromium(width: int = 1400, height: int = 1000) -> Iterator[WebDriver]:
    """A headless Chromium window of ``width`` × ``height`` CSS pixels; quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = _paths()
    if browser is None or driver is None:
        raise RuntimeError(chromium_missing())
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
    ):
        options.add_argument(flag)
    chrome = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    try:
        yield chrome
    finally:
        chrome.quit()
