"""The web console's weight and load time: the bundle's gzipped size, and in headless Chromium
(Debian's, through Playwright) the page's first contentful paint and its first data (the Room's
replica rows drawn from /admin/replicas), against a router on this machine.

  python benchmarks/console_load.py [--url http://127.0.0.1:30000] [--key KEY] [--runs 5]

Without --url it starts a router in this process over two of the router tests' fake replicas
(cpu:0, simxpu:0): what the Room shows comes from the router's own state, so the replicas' speed
does not enter. Each run is a fresh browser context (nothing cached)."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "polychip" / "console" / "static"


def bundle_sizes() -> dict:
    files = [p for p in STATIC.rglob("*") if p.is_file() and p.suffix in (".html", ".js", ".css")]
    raw = sum(p.stat().st_size for p in files)
    gz = sum(len(gzip.compress(p.read_bytes(), 9)) for p in files)
    return {"files": sorted(p.relative_to(STATIC).as_posix() for p in files), "bytes": raw, "gzip_bytes": gz}


def measure(url: str, key: str | None, runs: int) -> dict:
    from playwright.sync_api import sync_playwright
    paints, datas = [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        for _ in range(runs):
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            if key:     # the key as the page keeps it after the operator typed it once in this tab
                context.add_init_script(f"sessionStorage.setItem('polychip.console.key', {json.dumps(key)})")
            page = context.new_page()
            page.goto(url + "/console#room")
            page.wait_for_selector("tr[data-replica]")
            datas.append(page.evaluate("performance.now()"))
            paints.append(page.evaluate(
                "performance.getEntriesByName('first-contentful-paint')[0]?.startTime ?? null"))
            context.close()
        browser.close()
    return {"runs": runs, "first_contentful_paint_ms": _summary(paints), "first_data_ms": _summary(datas)}


def _summary(values) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None)
    p.add_argument("--key", default=None)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    out = {"bundle": bundle_sizes(), "load_average": os.getloadavg()}
    if args.url:
        out["page"] = measure(args.url.rstrip("/"), args.key, args.runs)
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from router_helpers import FakeReplica, ThreadServer, start_router, wait_for

        import httpx

        from polychip.router.settings import HealthConfig, RouterConfig
        with ThreadServer(FakeReplica(device="cpu:0").app) as a, ThreadServer(FakeReplica(device="simxpu:0").app) as b:
            server, _ = start_router(RouterConfig(health=HealthConfig(interval=0.3, success_threshold=1)),
                                     [a.url, b.url])
            try:
                wait_for(lambda: httpx.get(server.url + "/health").json()["replicas_up"] == 2, 30, "replicas up")
                out["page"] = measure(server.url, None, args.runs)
            finally:
                server.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
