"""The console's committed bundle (polychip/console/static) is what its sources build to, and the
routes serve it with the security headers.

The build records a hash of its sources (console/sources-hash.mjs); ``sources_hash`` recomputes it
the same way, so a source edited without a rebuild fails here. The rebuild test runs
``npm ci && vite build`` on a copy and compares every file byte for byte.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from polychip.http.console import CSP, STATIC, mount_console

pytestmark = pytest.mark.device_independent   # runs no model (conftest.py)

SOURCES = Path(__file__).resolve().parents[1] / "console"
FILES = ("index.html", "package.json", "package-lock.json", "vite.config.js", "sources-hash.mjs")
TREES = ("src", "public")


def sources_hash(root: Path) -> str:
    """sha256 over (path NUL content NUL) of the sources, paths sorted: as sources-hash.mjs does."""
    paths = [root / f for f in FILES] + [p for t in TREES for p in (root / t).rglob("*") if p.is_file()]
    h = hashlib.sha256()
    for rel in sorted(p.relative_to(root).as_posix() for p in paths):
        h.update(rel.encode() + b"\0")
        h.update((root / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def bundle_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and p.name != "SOURCES.sha256"}


def test_bundle_was_built_from_these_sources():
    recorded = (STATIC / "SOURCES.sha256").read_text().strip()
    assert recorded == sources_hash(SOURCES), ("console/ changed since the bundle was built: "
                                               "run `make console` and commit polychip/console/static")


def test_index_loads_only_its_own_assets():
    index = (STATIC / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]+)"', index)
    assert refs and all(r.startswith("/console/") for r in refs), refs
    for ref in refs:
        assert (STATIC / ref.removeprefix("/console/")).is_file(), ref


def test_routes_serve_the_page_and_assets_with_the_csp():
    app = FastAPI()
    mount_console(app)
    client = TestClient(app)
    for path in ("/console", "/console/"):
        r = client.get(path)
        assert r.status_code == 200 and '<div id="app">' in r.text
        assert r.headers["content-security-policy"] == CSP and r.headers["x-frame-options"] == "DENY"
    script = re.search(r'src="(/console/assets/[^"]+\.js)"', client.get("/console").text).group(1)
    r = client.get(script)
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    assert r.headers["content-security-policy"] == CSP and "immutable" in r.headers["cache-control"]
    assert client.get("/console/assets/nothing.js").status_code == 404
    assert "script-src 'self'" in CSP and "connect-src 'self'" in CSP and "unsafe" not in CSP


def test_a_fresh_build_matches_the_committed_bundle(tmp_path):
    npm = shutil.which("npm")
    assert npm, "npm is needed to rebuild the console (apt-get install -y nodejs npm; make install does it)"
    work = tmp_path / "console"
    shutil.copytree(SOURCES, work, ignore=shutil.ignore_patterns("node_modules"))
    run = lambda *cmd: subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
    done = run(npm, "ci", "--no-audit", "--no-fund")
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    done = run(npm, "exec", "--", "vite", "build", "--outDir", str(out), "--emptyOutDir")
    assert done.returncode == 0, done.stderr[-3000:]
    fresh, committed = bundle_files(out), bundle_files(STATIC)
    assert sorted(fresh) == sorted(committed)
    assert [n for n in fresh if fresh[n] != committed[n]] == []
