"""The hash of the console's sources, computed as ``console/sources-hash.mjs`` does (keep the two
in step): the build records it in ``static/SOURCES.sha256``; a test compares, so sources edited
without a rebuild fail."""
from __future__ import annotations

import hashlib
from pathlib import Path

FILES = ("index.html", "package.json", "package-lock.json", "vite.config.js", "sources-hash.mjs")
TREES = ("src", "public")


def sources_hash(root: Path) -> str:
    paths = [root / f for f in FILES] + [p for t in TREES for p in (root / t).rglob("*") if p.is_file()]
    h = hashlib.sha256()
    for rel in sorted(p.relative_to(root).as_posix() for p in paths):
        h.update(rel.encode() + b"\0")
        h.update((root / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()
