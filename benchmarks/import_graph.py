"""Which package of the top half imports which package of polychip (every import, also those in
function bodies; parsed as tests/test_layers.py does).

  python benchmarks/import_graph.py [ROOT]
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

TOP = ("polychip.commands", "polychip.router", "polychip.server", "polychip.http", "polychip.bench",
       "polychip.package")


def package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def graph(root: Path) -> dict[str, set[str]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_layers import imports
    out = defaultdict(set)
    for e in imports(root):
        src, dst = package(e.importer), package(e.target)
        if src in TOP and dst.startswith("polychip") and dst != src:
            out[src].add(dst.removeprefix("polychip."))
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    for src, dsts in sorted(graph(root).items()):
        print(f"{src.removeprefix('polychip.'):<9} -> {', '.join(sorted(dsts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
