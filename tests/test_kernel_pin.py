"""The CPU plugin's compiled kernel library (built per machine into the torch extensions cache,
which the serving user can write) is pinned like the plugin's files: a package records its
sha256, opening the package refuses other bytes under the pinned name, and the loader loads only
bytes that hash to the pin (a library swapped after the check, or one the pin does not name, is
not loaded: the native ops run). Run in a child process: the loader's state is per process."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from polychip.devices.cpu import kernels

pytestmark = pytest.mark.device_independent

SCENARIOS = r'''
import json, logging
from polychip.devices.cpu import kernels
from polychip.devices.discovery import open_device
from polychip.errors import PolychipError
from polychip.trust.pins import check_pin, pin_of

name, path = kernels.library()
plugin = open_device("cpu")
pin = pin_of(plugin)
out = {"pinned": pin["compiled"], "name": name}
original = open(path, "rb").read()

def fresh():
    kernels._state.clear()          # the loader tries once per process; each scenario is a new start

def tamper():
    with open(path, "ab") as f:
        f.write(b"\0")

def restore():
    with open(path, "wb") as f:
        f.write(original)

# 1. as pinned: the check passes and the pinned bytes load
fresh()
check_pin(pin, plugin, "p.pcpkg", False)
loaded = kernels.load()             # kept: a loaded extension is never unloaded
out["as_pinned"] = [loaded is not None, kernels.loaded_sha256()]
# 2. changed before the package is opened: refused, naming the library
fresh()
tamper()
try:
    check_pin(pin, plugin, "p.pcpkg", False)
    out["opened_modified"] = "opened"
except PolychipError as e:
    out["opened_modified"] = str(e)
restore()
# 3. swapped after the check, before the load: not loaded
fresh()
check_pin(pin, plugin, "p.pcpkg", False)
tamper()
out["swapped"] = [kernels.load() is None, kernels.unavailable_reason()]
restore()
# 4. a pin from another machine (another build name): this one is not loaded
fresh()
check_pin({**pin, "compiled": {"polychip_cpu_kernels_elsewhere": "0" * 64}}, plugin, "p.pcpkg", False)
out["unpinned"] = [kernels.load() is None, kernels.unavailable_reason()]
print(json.dumps(out))
'''

OVERRIDE = r'''
import json
from polychip.devices.cpu import kernels
from polychip.devices.discovery import open_device
from polychip.trust.pins import check_pin, pin_of

name, path = kernels.library()
plugin = open_device("cpu")
pin = pin_of(plugin)
with open(path, "ab") as f:
    f.write(b"\0")
check_pin(pin, plugin, "p.pcpkg", True)         # --allow-modified-plugin
print(json.dumps([kernels.load() is not None, kernels.loaded_sha256() != pin["compiled"][name]]))
'''


def _run_on_a_copy(tmp_path, script: str):
    """``script`` in a child whose torch extensions cache is a copy of the built one (the test
    changes its bytes); (its last line as JSON, its stderr)."""
    name, built = kernels.library()
    assert os.path.isfile(built), "make install builds the CPU kernels"
    cache = tmp_path / "extensions"
    shutil.copytree(os.path.dirname(built), cache / "polychip" / name)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def test_the_kernel_library_is_pinned_and_checked_before_it_loads(tmp_path):
    name, _ = kernels.library()
    out, _ = _run_on_a_copy(tmp_path, SCENARIOS)
    sha = out["pinned"][name]
    assert out["pinned"] == {name: sha} and len(sha) == 64
    assert out["as_pinned"] == [True, sha]
    assert f"compiled library {name}: modified" in out["opened_modified"] and "p.pcpkg" in out["opened_modified"]
    assert out["swapped"][0] and "modified since the package pinned it" in out["swapped"][1]
    assert out["unpinned"][0] and "not pinned by the package" in out["unpinned"][1]


def test_allow_modified_plugin_loads_a_changed_kernel_library_and_says_so(tmp_path):
    out, stderr = _run_on_a_copy(tmp_path, OVERRIDE)
    assert out == [True, True] and "TRUST OVERRIDE" in stderr and "compiled library" in stderr
