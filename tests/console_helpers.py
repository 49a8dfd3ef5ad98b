"""Driving the web console (/console) in Debian's headless Chromium with Playwright.

``ConsoleBrowser`` launches /usr/bin/chromium (``playwright install`` cannot download here); each
``ConsolePage`` records every console message, failed request and HTTP error the page saw, and
``assert_clean`` fails on any of them except the 404s and 401s the test says to expect (a 404 is
expected only for a route the test has checked is really missing on that server).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
VIEWS = ("room", "live", "rollout", "workloads", "batches", "chat")
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
# what each view asks the server for (the routes a 404 may come from)
PROBES = {"room": ["/admin/replicas", "/admin/devices"], "live": ["/admin/live"], "rollout": ["/admin/rollout"],
          "workloads": ["/admin/workloads"], "batches": ["/v1/batches"],
          "chat": ["/v1/models", "/admin/rollout", "/admin/replicas"]}


def need_chromium():
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make install does it)")


def missing_routes(url: str, key: str | None) -> set[str]:
    """The console's routes that answer 404 on this server (checked directly, not assumed)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    routes = {p for paths in PROBES.values() for p in paths} | {"/server_info"}
    return {p for p in routes if httpx.get(url + p, headers=headers, timeout=30).status_code == 404}


class ConsoleBrowser:
    def __init__(self):
        from playwright.sync_api import sync_playwright
        need_chromium()
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])

    def page(self, base_url: str, viewport=DESKTOP) -> "ConsolePage":
        return ConsolePage(self.browser.new_context(viewport=viewport), base_url)

    def close(self):
        self.browser.close()
        self._pw.stop()


class ConsolePage:
    def __init__(self, context, base_url: str):
        self.context, self.base = context, base_url
        self.page = context.new_page()
        self.console: list[tuple[str, str, str]] = []      # (type, text, url)
        self.failed: list[str] = []
        self.http_errors: list[tuple[int, str]] = []       # (status, path) of requests sent with the key
        self.keyless_errors: list[tuple[int, str]] = []    # the same of requests sent without one
        self.page.on("console", lambda m: self.console.append((m.type, m.text, m.location.get("url", ""))))
        self.page.on("pageerror", lambda e: self.console.append(("pageerror", str(e), "")))
        self.page.on("requestfailed", lambda r: self.failed.append(f"{r.url}: {r.failure}"))
        self.page.on("response", self._saw)

    def _saw(self, response) -> None:
        if response.status < 400:
            return
        seen = (response.status, response.url.removeprefix(self.base).split("?")[0])
        # by the request's own header, not by when it came back: a keyless poll sent before the key was
        # given may answer after it
        keyed = "authorization" in response.request.headers
        (self.http_errors if keyed else self.keyless_errors).append(seen)

    def open(self, view: str = "room"):
        self.page.goto(f"{self.base}/console#{view}")
        self.page.wait_for_selector("header nav")
        return self.page

    def show(self, view: str):
        self.page.click(f'nav a[data-view="{view}"]')
        self.page.wait_for_selector(f"main#view-{view}")
        return self.page

    def set_key(self, key: str):
        self.page.fill('input[name="api-key"]', key)
        self.page.click('.keybox button[type="submit"]')
        self.page.wait_for_selector(".keyset")

    def shot(self, folder: Path, name: str) -> Path:
        path = Path(folder) / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def assert_clean(self, missing: set[str] = frozenset(), locked: bool = False):
        """No console error, no failed request, no HTTP error but the 404s of ``missing`` routes
        and 401s of the page's reads sent without the key (of keyed ones too when ``locked``)."""
        probes = {p for paths in PROBES.values() for p in paths} | {"/server_info"}
        allowed = {404: set(missing), 401: probes if locked else set()}
        unexpected = [(s, p) for s, p in self.http_errors if p not in allowed.get(s, ())]
        unexpected += [(s, p) for s, p in self.keyless_errors if not (s == 401 and p in probes or p in missing)]
        assert not unexpected, f"unexpected HTTP errors: {unexpected}"
        assert not self.failed, f"failed requests: {self.failed}"
        if self.keyless_errors:
            allowed[401] = probes
        bad = [(t, text, url) for t, text, url in self.console if t in ("error", "pageerror", "warning")
               and not _is_allowed_status_log(text, url, self.base, allowed)]
        assert not bad, f"browser console errors: {bad}"

    def close(self):
        self.context.close()


def _is_allowed_status_log(text: str, url: str, base: str, allowed: dict) -> bool:
    """Chromium logs each 4xx response as a console error; those the test expects are fine."""
    path = url.removeprefix(base).split("?")[0]
    return any(f"status of {status}" in text and path in paths for status, paths in allowed.items())


def screens_dir(tmp_path_factory) -> Path:
    """Where the screenshots go: $POLYCHIP_CONSOLE_SCREENS if set, else the test's tmp folder."""
    given = os.environ.get("POLYCHIP_CONSOLE_SCREENS")
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        return Path(given)
    return tmp_path_factory.mktemp("console-screens")
