"""The top half's rules, beyond the import parse of test_layers.py: the router really loads no
torch, engine, models, ops, devices or server (checked in a fresh interpreter), and the
modules of the top half import each other without a cycle."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_layers import REPO, imports, layer_of, violations

pytestmark = pytest.mark.device_independent   # runs no device (conftest.py)

HEAVY = ("torch", "polychip.engine", "polychip.models", "polychip.ops", "polychip.devices", "polychip.server",
         "polychip.quant", "polychip.distributed")


def loaded_after(code: str) -> list[str]:
    """The heavy modules in sys.modules after ``code`` runs in a fresh interpreter."""
    probe = textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "torch"
                                or any(m == h or m.startswith(h + ".") for h in {HEAVY!r}))))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_router_loads_no_torch_engine_or_devices():
    assert loaded_after("import polychip.router.app, polychip.router.routes.openai_api, "
                        "polychip.router.fleet.placement, polychip.router.fleet.launcher") == []


def test_router_help_loads_no_torch_engine_or_devices():
    assert loaded_after("""
        import contextlib, io
        from polychip import cli
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            cli.main(["router", "--help"])
    """) == []


def test_the_check_sees_a_heavy_import():
    """The probe itself can fail: importing the server's app loads the engine and torch."""
    found = loaded_after("import polychip.server.openai_api")
    assert "torch" in found and "polychip.engine.engine" in found


TOP = ("commands", "server", "router", "edge", "library")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle among the modules (one per strongly connected group), by Tarjan's algorithm."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def top_half_graph(root) -> dict[str, set[str]]:
    known = {e.importer for e in imports(root)}
    graph: dict[str, set[str]] = {}
    for e in imports(root):
        if layer_of(e.importer) in TOP and e.target in known and layer_of(e.target) in TOP:
            graph.setdefault(e.importer, set()).add(e.target)
    return graph


def test_the_top_half_has_no_import_cycle():
    assert cycles(top_half_graph(REPO)) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_top_half_rules_are_reported(tmp_path):
    planted = {
        "polychip/__init__.py": "",
        "polychip/router/__init__.py": "",
        "polychip/router/app.py": "from polychip.server import serving\nimport polychip.devices.spec\n"
                                  "from polychip.http import gate\n",
        "polychip/server/__init__.py": "",
        "polychip/server/serving.py": "from polychip.router import app\nfrom polychip.http import gate\n",
        "polychip/http/__init__.py": "",
        "polychip/http/gate.py": "from polychip.engine import engine\nfrom polychip.errors import ConfigError\n",
        "polychip/package/__init__.py": "",
        "polychip/package/op_plan.py": "from polychip.commands.coverage import op_rows\n",
    }
    for rel, text in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = [line.split(": ", 1)[1].split(")")[0] + ")" for line in violations(tmp_path, set())]
    assert sorted(found) == sorted([
        "polychip.router.app imports polychip.server.serving (router -> server)",
        "polychip.router.app imports polychip.devices.spec (router -> devices)",
        "polychip.server.serving imports polychip.router.app (server -> router)",
        "polychip.http.gate imports polychip.engine (edge -> engine)",
        "polychip.package.op_plan imports polychip.commands.coverage (library -> commands)",
    ])
