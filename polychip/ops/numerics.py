"""Deprecated (API 1.0 path): the kit's ``numerics`` moved to ``polychip.pluginkit.numerics`` in API 1.1.

This alias keeps 1.0 vendor tests importing for one minor version (removed in API 1.2); it warns
once on import. It belongs to the kit's layer (tests/test_layers.py), not to the plugin layer.
"""
import sys
import warnings

from polychip.pluginkit import numerics as _moved

warnings.warn("polychip.ops.numerics is deprecated since plugin API 1.1 and goes in 1.2: import "
              "polychip.pluginkit.numerics", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
