"""Function length across polychip/: max, median and p90 of every def's line count (decorators
excluded, docstring included), and the longest ones.

  python tests/function_lengths.py [ROOT] [--top N] [--limit 60]

Exit status 1 when a function is longer than --limit (0 to report only)."""
from __future__ import annotations

import argparse
import ast
import statistics
import sys
from pathlib import Path


def lengths(root: Path) -> list[tuple[int, str]]:
    """(lines, 'path:line name') for every function and method under root/polychip."""
    out = []
    for f in sorted((root / "polychip").rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"), str(f))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{f.relative_to(root)}:{node.lineno} {node.name}"))
    return out


def percentile(values: list[int], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--limit", type=int, default=0)
    args = p.parse_args(argv)
    found = lengths(Path(args.root))
    sizes = [n for n, _ in found]
    print(f"{len(sizes)} functions: max {max(sizes)}, median {statistics.median(sizes):g}, "
          f"p90 {percentile(sizes, 90):g}")
    for n, where in sorted(found, reverse=True)[:args.top]:
        print(f"  {n:4d}  {where}")
    over = [w for n, w in found if args.limit and n > args.limit]
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
