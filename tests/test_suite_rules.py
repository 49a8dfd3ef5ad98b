"""POLYCHIP_TEST_DEVICE covers the suite: outside the modules marked device_independent, every call
that runs a model (LLM, EngineConfig, open_device, ServerProcess) takes the device from the fixture."""
from __future__ import annotations

import ast
import glob
import os

import pytest

pytestmark = pytest.mark.device_independent   # reads test sources, runs no model

TESTS = os.path.dirname(os.path.abspath(__file__))


def _marked_independent(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
               and "device_independent" in ast.unparse(n.value) for n in tree.body)


def _name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def device_problems(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    if _marked_independent(tree):
        return []
    out = []
    scope_of = {id(n): f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for n in ast.walk(f)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, where = _name(node), f"{os.path.basename(path)}:{node.lineno}"
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if name in ("LLM", "EngineConfig") and (device is None or isinstance(device, ast.Constant)):
            out.append(f"{where}: {name}(...) without device=<the test_device fixture>")
        elif name == "open_device" and node.args and isinstance(node.args[0], ast.Constant):
            out.append(f"{where}: open_device({node.args[0].value!r})")
        elif name == "ServerProcess" and "device_args" not in ast.unparse(scope_of.get(id(node), node)):
            out.append(f"{where}: ServerProcess without *device_args")
    return out


def test_every_model_run_outside_device_independent_modules_uses_the_test_device():
    files = sorted(glob.glob(os.path.join(TESTS, "test_*.py")))
    problems = [p for f in files for p in device_problems(f)]
    assert len(files) > 25 and not problems, problems


def test_the_rule_catches_a_hard_coded_device(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text('LLM(path, device="cpu")\nLLM(path)\nopen_device("cpu")\nServerProcess(["--port", "1"])\n'
                   'LLM(path, device=test_device)\n\n'
                   'def f(device_args):\n    args = ["--x", *device_args]\n    ServerProcess(args)\n')
    assert [p.split(": ", 1)[1] for p in device_problems(str(bad))] == [
        "LLM(...) without device=<the test_device fixture>", "LLM(...) without device=<the test_device fixture>",
        "open_device('cpu')", "ServerProcess without *device_args"]
