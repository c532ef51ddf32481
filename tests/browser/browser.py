"""Debian's headless Chromium under selenium, with nothing downloaded and no network chatter.

Selenium is pointed at /usr/bin/chromedriver and /usr/bin/chromium; Selenium Manager (which
would download a driver or a browser) is made to fail loudly if anything ever reaches it.
The flags keep Chromium off the network (no component updates, sync, background fetches)
and every driver gets a fresh profile directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--no-default-browser-check", "--disable-extensions", "--disable-default-apps",
         "--disable-features=Translate,MediaRouter,OptimizationHints,AutofillServerCommunication",
         "--hide-scrollbars", "--force-device-scale-factor=1"]
NARROW = (420, 900)
WIDE = (1400, 900)

ROOT = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    """Screenshots land here (printed at the end of the run)."""
    path = Path(os.environ.get("CLOUD_AGENT_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _no_selenium_manager(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("Selenium Manager must never run here (it downloads drivers and browsers)")


@contextmanager
def chromium(size: tuple[int, int] = WIDE) -> Iterator[Any]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail(f"{CHROMIUM} / {CHROMEDRIVER} missing: run ./scripts/test (its browser step installs "
                    "Debian's chromium and chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common import selenium_manager

    selenium_manager.SeleniumManager.binary_paths = _no_selenium_manager  # type: ignore[method-assign]
    profile = tempfile.mkdtemp(prefix="inspector-chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.add_argument(f"--window-size={size[0]},{size[1]}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """The browser log's SEVERE entries since the last read (reading clears it)."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def full_page_screenshot(driver: Any, path: Path, width: int) -> Path:
    """The whole page, not only the viewport: grow the window to the document's height."""
    height = driver.execute_script("return Math.ceil(document.documentElement.scrollHeight)")
    driver.set_window_size(width, min(max(int(height) + 20, 400), 8000))
    driver.save_screenshot(str(path))
    return path
