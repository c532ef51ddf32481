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
    """The whole page at ``width`` CSS pixels, not only the viewport (DevTools protocol)."""
    import base64

    driver.execute_script("window.scrollTo(0, 0)")
    height = int(driver.execute_script("return Math.ceil(document.documentElement.scrollHeight)"))
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    try:
        height = int(driver.execute_script("return Math.ceil(document.documentElement.scrollHeight)"))
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


# Every element that shows text of its own: its text colour against the first opaque
# background behind it, as WCAG 2 computes contrast (AA: 4.5:1, large text 3:1).
CONTRAST_JS = """
const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
const lum = ([r, g, b]) => {
  const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
  return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
};
const background = (el) => {
  for (let n = el; n; n = n.parentElement) {
    const c = rgb(getComputedStyle(n).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0)) return c.slice(0, 3);
  }
  return [255, 255, 255];
};
const out = [];
for (const el of document.querySelectorAll("body *")) {
  const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
  const style = getComputedStyle(el);
  if (!own || style.visibility === "hidden" || el.offsetParent === null && style.position !== "fixed") continue;
  const a = lum(rgb(style.color)), b = lum(background(el));
  const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  const size = parseFloat(style.fontSize), bold = Number(style.fontWeight) >= 700;
  const need = size >= 24 || (bold && size >= 18.66) ? 3 : 4.5;
  if (ratio < need) out.push({ text: el.textContent.trim().slice(0, 40), ratio: Math.round(ratio * 100) / 100,
                               color: style.color, cls: el.className });
}
return out;
"""


def low_contrast(driver: Any) -> list[dict[str, Any]]:
    return driver.execute_script(CONTRAST_JS)
