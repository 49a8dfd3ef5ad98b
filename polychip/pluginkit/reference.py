"""polychip's native reference ops, public for a vendor's own unit tests (plugin API 1.1).

The plugin itself receives the native ops through ``registry.native(name)`` inside
``register_ops``; a vendor's tests compare their kernels against the same functions here::

    from polychip.pluginkit import reference
    want = reference.op("rms_norm")(x, weight, 1e-6)
    args = reference.sample_inputs("attention", "bfloat16")    # the kit's own random cases
    check = reference.compare("attention", my_attention)      # an OpCheck, as `polychip probe` prints

Every name of the op contract (``polychip.devices.ops.OPS``) with a native implementation is here.
"""
from __future__ import annotations

from typing import Callable

from polychip.ops.native import NATIVE_OPS
from polychip.pluginkit.numerics import OpCheck, attention_cases, sample_inputs
from polychip.pluginkit.numerics import compare as _compare

__all__ = ["OPS", "op", "sample_inputs", "attention_cases", "compare", "OpCheck"]

#: op name -> the native reference implementation (version 1 of each op)
OPS: dict[str, Callable] = dict(NATIVE_OPS)


def op(name: str, version: int = 1) -> Callable:
    """The native reference of op ``name`` (version 1: the only version the contract has today)."""
    if version != 1 or name not in OPS:
        raise KeyError(f"no native reference for op {name!r} v{version}; known: {sorted(OPS)} (v1)")
    return OPS[name]


def compare(name: str, fn: Callable, dtype: str = "float32", device_put: Callable = lambda t: t,
            seed: int = 0, kv_dtype: str | None = None) -> OpCheck:
    """``fn`` against the native reference on the kit's random inputs for ``name`` in ``dtype``."""
    return _compare(name, 1, dtype, fn, op(name), device_put, seed, kv_dtype)
