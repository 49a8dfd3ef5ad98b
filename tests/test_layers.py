"""The layer rules of DESIGN.md, held by parsing every import in polychip/ with ``ast``.

Every import counts: top-level, inside functions, under ``if TYPE_CHECKING``, relative ones
(``from . import x``, ``from ..ops import y``) and ``importlib.import_module("polychip....")`` /
``__import__`` with a literal (or f-string) name. Lower layers never import higher ones:

    commands (cli, serve, commands/)            nothing in the library imports them
    router   server   library (bench, package, the polychip facade)
    edge (http/)                                what the server and the router share, and all they share
    trust                                       keys, trust store, signed YAML, pins, seccomp: for router and library
    pluginkit
    engine
    models  ops  quant  distributed
    devices
    config.py  errors.py  dtypes.py  yaml_file.py  flags.py

The router talks HTTP to replicas: it imports only the edge, itself and the leaves.
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

REPO = Path(__file__).resolve().parents[1]

# module prefix -> layer; the longest prefix wins ("polychip" itself matches only the package facade,
# LLM and SamplingParams, so that a new subpackage must be given its layer here)
LAYER_OF = {
    "polychip": "library",
    "polychip.cli": "commands",
    "polychip.serve": "commands",
    "polychip.commands": "commands",
    "polychip.batch": "commands",           # polychip batch's own parts (engine in-process, progress bar)
    "polychip.server": "server",
    "polychip.router": "router",
    "polychip.http": "edge",
    "polychip.bench": "library",
    "polychip.package": "library",
    "polychip.trust": "trust",              # keys, the trust store, signed YAML, plugin pins, seccomp
    "polychip.pluginkit": "pluginkit",
    "polychip.engine": "engine",
    "polychip.models": "models",
    "polychip.ops": "ops",
    "polychip.quant": "quant",
    "polychip.distributed": "distributed",
    "polychip.devices": "devices",
    "polychip.config": "leaves",
    "polychip.errors": "leaves",
    "polychip.dtypes": "leaves",            # the dtype vocabulary
    "polychip.yaml_file": "leaves",         # reading a YAML file (specs, deployments)
    "polychip.flags": "leaves",             # the one CLI generator (parsers, flags of the config dataclasses)
    "polychip.version": "leaves",           # __version__
}

TOP = {"commands", "server", "router", "library", "edge"}
ABOVE_ENGINE = {"pluginkit"} | TOP
ABOVE_MODELS = {"engine"} | ABOVE_ENGINE
BELOW_EDGE = {"pluginkit", "engine", "models", "ops", "quant", "distributed", "devices"}
# importer layer -> (layers it must not import, the rule in words)
FORBIDDEN = {
    "leaves": (set(LAYER_OF.values()) - {"leaves"}, "config.py, errors.py, dtypes.py, yaml_file.py and flags.py "
                                                    "import nothing from the package but each other"),
    "devices": ({"ops", "models", "quant", "distributed"} | ABOVE_MODELS,
                "the plugin layer (devices/) never imports ops, models, the engine, the server or the kit"),
    "ops": ({"models"} | ABOVE_MODELS, "ops never import models or the engine (or above)"),
    "models": (ABOVE_MODELS, "models never import the engine or above"),
    "quant": (ABOVE_MODELS, "quant never imports the engine or above"),
    "distributed": (ABOVE_MODELS, "distributed never imports the engine or above"),
    "engine": (ABOVE_ENGINE, "the engine never imports the server, the router, the edge, the CLI, the bench "
                             "or the kit"),
    "pluginkit": (TOP, "the kit never imports the entry points"),
    "edge": (TOP - {"edge"} | BELOW_EDGE, "the edge (http/) imports only the leaves: no engine, devices, "
                                          "server, router or CLI"),
    "server": ({"commands", "router"}, "the server never imports the router or the CLI (they share only the edge)"),
    "router": (TOP - {"router", "edge"} | BELOW_EDGE,
               "the router imports only the edge and the leaves: no server, engine, models, ops, devices or CLI"),
    "library": ({"commands", "server", "router"}, "no library module imports the CLI, the server or the router"),
    "trust": (set(LAYER_OF.values()) - {"leaves", "trust"}, "the trust library (trust/) imports only the "
                                                              "leaves: the router and the library both use it"),
    "commands": (set(), ""),
}
OUT_OF_TREE = "nothing in polychip/ imports an out-of-tree plugin"
IMPORT_FUNCS = {"import_module", "__import__"}


@dataclass(frozen=True)
class Edge:
    path: str      # file, relative to the scanned root
    line: int
    importer: str  # dotted module name
    target: str    # dotted module name imported


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    """('polychip.devices.cpu', True) for polychip/devices/cpu/__init__.py."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _literal_prefix(node: ast.AST) -> str | None:
    """A string constant, or the constant head of an f-string ('polychip.commands.' of f'...{name}')."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value.rstrip(".")
    return None


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    # `from pkg import sub` imports the submodule pkg.sub when there is one, else a name of pkg
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def imports(root: Path) -> list[Edge]:
    """Every import in every .py file under root/polychip, with its line."""
    files = sorted((root / "polychip").rglob("*.py"))
    known = {module_name(root, f)[0] for f in files}
    edges = []
    for f in files:
        module, is_package = module_name(root, f)
        rel = str(f.relative_to(root))
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), rel)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve_from(node, module, is_package, known)
            elif isinstance(node, ast.Call) and node.args and (
                    getattr(node.func, "id", None) in IMPORT_FUNCS or getattr(node.func, "attr", None) in IMPORT_FUNCS):
                targets = [t for t in [_literal_prefix(node.args[0])] if t]
            else:
                continue
            edges += [Edge(rel, node.lineno, module, t) for t in targets]
    return list(dict.fromkeys(edges))      # `from m import a, b` is one edge


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 0 if module == "polychip" else 1, -1):
        layer = LAYER_OF.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def out_of_tree_packages(repo: Path) -> set[str]:
    """The import names the plugins under plugins/ install (each is a separate package)."""
    names = set()
    for plugin in (repo / "plugins").iterdir():
        for entry in plugin.iterdir() if plugin.is_dir() else ():
            if (entry / "__init__.py").exists():
                names.add(entry.name)
            elif entry.suffix == ".py" and entry.name != "setup.py":
                names.add(entry.stem)
    return names


def violations(root: Path, plugin_packages: set[str]) -> list[str]:
    """One line per import that breaks a rule, naming file, line, both modules and the rule."""
    found = []
    for e in imports(root):
        top = e.target.split(".")[0]
        where = f"{e.path}:{e.line}: {e.importer} imports {e.target}"
        if top in plugin_packages or top == "plugins" or top.startswith("polychip_"):
            found.append(f"{where}: {OUT_OF_TREE}")
            continue
        if top != "polychip":
            continue
        mine, theirs = layer_of(e.importer), layer_of(e.target)
        forbidden, rule = FORBIDDEN[mine]
        if theirs in forbidden:
            found.append(f"{where} ({mine} -> {theirs}): {rule}")
    return found


def unlayered(root: Path) -> list[str]:
    modules = (module_name(root, f)[0] for f in (root / "polychip").rglob("*.py"))
    return sorted(m for m in modules if layer_of(m) is None)


# the real tree

def test_every_module_of_the_package_has_a_layer():
    assert not unlayered(REPO), "give these modules a layer in LAYER_OF"


def test_the_package_keeps_the_layer_rules():
    assert violations(REPO, out_of_tree_packages(REPO)) == []


def test_simxpu_is_seen_as_an_out_of_tree_package():
    assert "polychip_simxpu" in out_of_tree_packages(REPO)


def test_every_kind_of_import_is_parsed():
    """The checker sees imports in function bodies and the CLI's import_module f-string."""
    edges = imports(REPO)
    cli = {e.target for e in edges if e.importer == "polychip.cli"}
    assert "polychip.commands" in cli                                    # import_module(f"polychip.commands.{name}")
    lazy = {e.target for e in edges if e.importer == "polychip"}
    assert "polychip.package.trusted_llm" in lazy                        # inside the facade's __getattr__


# the checker on planted violations

PLANTED = {
    "polychip/__init__.py": "",
    "polychip/config.py": """
        from polychip.errors import ConfigError          # fine: leaves import each other
        from polychip.devices import spec                # config imports a layer above
    """,
    "polychip/errors.py": "",
    "polychip/devices/__init__.py": "from . import plugin\n",
    "polychip/devices/plugin.py": "from polychip.errors import PluginError\n",
    "polychip/devices/bad.py": """
        import importlib
        from polychip.engine.engine import Engine        # engine
        from . import plugin                             # fine: its own layer

        def later(name):
            from ..ops import native                     # relative, in a function body
            from .. import models                        # `from .. import` a subpackage
            importlib.import_module("polychip.server.app")
            importlib.import_module(f"polychip.pluginkit.{name}")
            import polychip_simxpu                       # an out-of-tree plugin
    """,
    "polychip/engine/__init__.py": "",
    "polychip/engine/engine.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from polychip.commands import serve          # the CLI
    """,
    "polychip/ops/__init__.py": "",
    "polychip/ops/native.py": "from polychip.models.decoder import DecoderModel\n",
    "polychip/models/__init__.py": "",
    "polychip/models/decoder.py": "import polychip.engine.engine\nfrom polychip.ops import native\n",
}


def plant(tmp_path: Path) -> Path:
    for rel, text in PLANTED.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_planted_violations_are_each_reported(tmp_path):
    found = violations(plant(tmp_path), {"polychip_simxpu"})
    expected = [
        "polychip/config.py:3: polychip.config imports polychip.devices (leaves -> devices)",
        "polychip/devices/bad.py:3: polychip.devices.bad imports polychip.engine.engine (devices -> engine)",
        "polychip/devices/bad.py:7: polychip.devices.bad imports polychip.ops.native (devices -> ops)",
        "polychip/devices/bad.py:8: polychip.devices.bad imports polychip.models (devices -> models)",
        "polychip/devices/bad.py:9: polychip.devices.bad imports polychip.server.app (devices -> server)",
        "polychip/devices/bad.py:10: polychip.devices.bad imports polychip.pluginkit (devices -> pluginkit)",
        "polychip/devices/bad.py:11: polychip.devices.bad imports polychip_simxpu: nothing in polychip/ imports "
        "an out-of-tree plugin",
        "polychip/engine/engine.py:4: polychip.engine.engine imports polychip.commands (engine -> commands)",
        "polychip/ops/native.py:1: polychip.ops.native imports polychip.models.decoder (ops -> models)",
        "polychip/models/decoder.py:1: polychip.models.decoder imports polychip.engine.engine (models -> engine)",
    ]
    assert len(found) == len(expected), "\n".join(found)
    for want in expected:
        assert any(got.startswith(want) for got in found), f"{want!r} not reported in:\n" + "\n".join(found)
    rules = tuple(rule for _, rule in FORBIDDEN.values() if rule) + (OUT_OF_TREE,)
    assert all(line.endswith(rules) for line in found)                     # each line names its rule


def test_a_module_without_a_layer_is_reported(tmp_path):
    root = plant(tmp_path)
    (root / "polychip/newthing").mkdir()
    (root / "polychip/newthing/__init__.py").write_text("")
    assert unlayered(root) == ["polychip.newthing"]


def test_the_planted_tree_is_clean_once_the_violations_go(tmp_path):
    root = plant(tmp_path)
    (root / "polychip/devices/bad.py").unlink()
    for rel, keep in (("polychip/config.py", "from polychip.errors import ConfigError\n"),
                      ("polychip/engine/engine.py", "from polychip.models import decoder\nimport polychip.ops\n"),
                      ("polychip/ops/native.py", "from polychip.devices import plugin\n"),
                      ("polychip/models/decoder.py", "from polychip.ops import native\nimport polychip.devices\n")):
        (root / rel).write_text(keep)
    assert violations(root, {"polychip_simxpu"}) == []
