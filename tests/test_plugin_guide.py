"""docs/plugin-guide.md stays true: its worked example runs as written, it names every method of the
plugin API, and every public method in plugin.py has a docstring."""
from __future__ import annotations

import inspect
import os
import re

import pytest

from polychip.devices import plugin as api
from polychip.pluginkit import conformance

pytestmark = pytest.mark.device_independent   # runs simxpu, as the guide does

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "plugin-guide.md")


def guide() -> str:
    return open(GUIDE, encoding="utf-8").read()


def public_methods(cls) -> list[str]:
    return [n for n, f in vars(cls).items() if callable(f) and not n.startswith("_")]


def test_every_public_method_of_the_plugin_api_has_a_docstring_and_is_in_the_guide():
    text = guide()
    for cls in (api.DevicePlugin, api.Stream, api.Event):
        for name in public_methods(cls):
            assert inspect.getdoc(getattr(cls, name)), f"{cls.__name__}.{name} has no docstring"
            if cls is api.DevicePlugin:
                assert f"`{name}" in text, f"the guide never mentions DevicePlugin.{name}"
    for name in ("parse_api_version", "api_mismatch", "capped_mem_info"):
        assert inspect.getdoc(getattr(api, name)), name


def test_the_worked_example_grows_simxpu_by_linear(tmp_path):
    from polychip.engine.coverage import coverage_rows
    code = re.search(r"```python\n(# my_simxpu\.py\n.*?)```", guide(), re.S).group(1)
    path = tmp_path / "my_simxpu.py"
    path.write_text(code)
    model = conformance.make_tiny_model(str(tmp_path / "tiny"))
    rows, lm, plugin, _ = coverage_rows(model, "simxpu", (str(path),))
    linear = next(r for r in rows if r["op"] == "linear")
    assert type(plugin).__name__ == "SimXpuWithLinear"
    assert linear["implementation"] == "plugin:simxpu" and linear["reason"] == "registered for float32"
    target = conformance.Target("simxpu", plugins=(str(path),))
    results = {name: (ok, msg) for name, ok, msg in conformance.run(target, ["op_numerics", "generation",
                                                                             "bf16_generation"])}
    assert all(ok for ok, _ in results.values()), results
    assert results["op_numerics"][1] == "11 op check(s) pass, 0 skipped"      # simxpu's 9 + linear in 2 dtypes
