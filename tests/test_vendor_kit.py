"""What a second vendor tripped on (issue 28): each item held by a test."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.device_independent   # names its devices (conftest.py)


@pytest.mark.parametrize("old,new", [("polychip.devices.conformance", "polychip.pluginkit.conformance"),
                                     ("polychip.devices.probe", "polychip.pluginkit.probe"),
                                     ("polychip.ops.numerics", "polychip.pluginkit.numerics")])
def test_the_api_1_0_kit_paths_still_import_with_a_deprecation_warning(old, new):
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import {old}\nexcept DeprecationWarning as e:\n    print('warned:', e)\n"
            f"warnings.simplefilter('ignore')\nimport {old} as a, {new} as b\nprint('same', a is b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"warned: {old} is deprecated since plugin API 1.1" in out.stdout and new in out.stdout
    assert "same True" in out.stdout
