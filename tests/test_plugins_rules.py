"""Rules a grep or a parse can check: torch.cuda only in the CUDA plugin; plugins use only the API."""
from __future__ import annotations

import glob
import os
import re
import textwrap

import pytest

from polychip.pluginkit.conformance import source_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMXPU = sorted(glob.glob(os.path.join(ROOT, "plugins", "simxpu", "polychip_simxpu", "*.py")))


def core_files():
    return sorted(glob.glob(os.path.join(ROOT, "polychip", "**", "*.py"), recursive=True))


def test_no_torch_cuda_outside_the_cuda_plugin():
    pattern = re.compile(r"torch\.cuda|\.cuda\(")
    offenders = []
    for path in core_files():
        rel = os.path.relpath(path, ROOT)
        if re.fullmatch(r"polychip/devices/cuda[^/]*\.py", rel):
            continue
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert len(core_files()) > 20 and not offenders, offenders


def test_the_core_never_imports_simxpu():
    hits = [p for p in core_files() if "polychip_simxpu" in open(p, encoding="utf-8").read()]
    assert not hits


@pytest.mark.parametrize("path", SIMXPU, ids=os.path.basename)
def test_simxpu_uses_only_the_plugin_api(path):
    assert source_problems(path) == []


def test_the_source_checker_catches_private_imports_and_monkey_patching(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""
        import torch
        import polychip.engine.engine
        from polychip.ops import native
        from polychip.devices.plugin import _private
        from polychip.devices import plugin
        torch.nn.functional.silu = lambda x: x
        plugin.API_VERSION += 1
        setattr(native, "linear", None)
        local = {}
        local["fine"] = 1
    """))
    problems = source_problems(str(bad))
    assert len(problems) == 6, problems
    for text in ("imports polychip.engine.engine", "imports from polychip.ops", "private name _private",
                 "assigns to torch.nn.functional.silu", "assigns to plugin.API_VERSION", "setattr on imported native"):
        assert any(text in p for p in problems), (text, problems)
