"""The router's rooms import one way (issue 32): routes -> routing -> rollout -> fleet -> state, never back
(what composes them, app.py and reconciler.py, sits above the rooms);
the check is on the source's imports (ast), so a lazy import inside a function counts too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.device_independent

ROUTER = Path(__file__).resolve().parent.parent / "polychip" / "router"
RANK = {"state": 0, "fleet": 1, "rollout": 2, "routing": 3, "routes": 4}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["polychip", "router"] and parts[2] in RANK else None


def back_edges(root: Path = ROUTER) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        here = path.relative_to(root).parts[0]
        if here not in RANK:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [])
            for name in names:
                there = _room(name)
                if there is not None and there != here and RANK[there] >= RANK[here]:
                    found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_the_rooms_import_one_way():
    assert back_edges() == []


def test_the_check_sees_a_back_edge(tmp_path):
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "x.py").write_text("def f():\n    from polychip.router.routing.dispatch import Dispatcher\n")
    assert back_edges(tmp_path) == ["fleet/x.py imports polychip.router.routing.dispatch"]
