"""Op registry: plugin exact match, then '*', then native; each fallback reasoned, logged once, counted."""
from __future__ import annotations

import logging

import pytest
import torch

from polychip.errors import PluginError
from polychip.ops.native import NATIVE_OPS, register_native
from polychip.ops.recording import RecordingRegistry
from polychip.ops.registry import OpRegistry


def plugin_fn(*a):
    return "plugin"


def any_fn(*a):
    return "any"


@pytest.fixture
def reg():
    r = OpRegistry("chip")
    register_native(r)
    return r


def test_exact_match_beats_wildcard_beats_native(reg):
    reg.register("rms_norm", 1, "bfloat16", plugin_fn)
    reg.register("rms_norm", 1, "*", any_fn)
    assert reg.resolve("rms_norm", 1, "bfloat16").fn is plugin_fn
    assert reg.resolve("rms_norm", 1, "float32").fn is any_fn
    res = reg.resolve("linear", 1, "float32")
    assert res.fn is NATIVE_OPS["linear"] and res.source == "native" and res.is_fallback
    assert reg.resolve("rms_norm", 1, "float32").source == "plugin:chip"


def test_fallback_reasons_name_what_is_missing(reg):
    reg.register("silu_mul", 1, "bfloat16", plugin_fn)
    reg.register("attention", 2, "float32", plugin_fn)
    assert reg.resolve("linear", 1, "float32").reason == "plugin 'chip' does not implement linear"
    assert reg.resolve("silu_mul", 1, "float32").reason == \
        "plugin 'chip' has silu_mul v1 only for ['bfloat16'], not float32"
    assert reg.resolve("attention", 1, "float32").reason == \
        "plugin 'chip' has attention only in version(s) [2], not v1"


def test_each_fallback_logged_once_and_counted(reg, caplog):
    reg.register("embedding", 1, "*", plugin_fn)
    with caplog.at_level(logging.INFO, logger="polychip.ops"):
        for _ in range(3):
            reg.resolve("linear", 1, "float32")
            reg.resolve("embedding", 1, "float32")
    lines = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert lines == ["op fallback: linear v1 float32 -> native (plugin 'chip' does not implement linear)"]
    assert reg.stats == {"plugin": 1, "fallback": 1}
    assert [r.name for r in reg.fallbacks()] == ["linear"]


def test_unknown_op_has_no_native_reference(reg):
    with pytest.raises(KeyError, match="no native reference"):
        reg.resolve("fused_moe", 1, "float32")


@pytest.mark.parametrize("args,match", [
    (("", 1, "float32", plugin_fn), "non-empty string"),
    (("rms_norm", 0, "float32", plugin_fn), "version must be an integer >= 1"),
    (("rms_norm", True, "float32", plugin_fn), "version must be an integer >= 1"),
    (("rms_norm", 1, "fp32", plugin_fn), "dtype must be '\\*' or one of"),
    (("rms_norm", 1, "float32", "not callable"), "is not callable"),
])
def test_bad_registrations_are_plugin_errors(reg, args, match):
    with pytest.raises(PluginError, match=match):
        reg.register(*args)


def test_double_registration_is_refused(reg):
    reg.register("rms_norm", 1, "float32", plugin_fn)
    with pytest.raises(PluginError, match="twice"):
        reg.register("rms_norm", 1, "float32", any_fn)


def test_registering_after_resolve_re_resolves(reg):
    assert reg.resolve("silu_mul", 1, "float32").source == "native"
    reg.register("silu_mul", 1, "float32", plugin_fn)
    assert reg.resolve("silu_mul", 1, "float32").fn is plugin_fn


def test_recording_registry_counts_calls_per_key():
    reg = RecordingRegistry("chip")
    register_native(reg)
    reg.register("silu_mul", 1, "float32", lambda g, u: g * u)
    silu = reg.resolve("silu_mul", 1, "float32").fn
    linear = reg.resolve("linear", 1, "float32").fn
    reg.resolve("rms_norm", 1, "float32")            # resolved but never called
    x = torch.ones(2, 3)
    silu(x, x)
    silu(x, x)
    out = linear(x, torch.eye(3))
    assert torch.equal(out, x)
    used = {r.name: (r.source, n) for r, n in reg.used()}
    assert used == {"silu_mul": ("plugin:chip", 2), "linear": ("native", 1)}


def test_unavailable_op_reason_reaches_the_fallback():
    from polychip.ops.registry import OpRegistry
    reg = OpRegistry("cpu")
    reg.register_native("linear", 1, lambda x, w, b=None: x)
    reg.register_unavailable("linear", "C++ kernels did not build (no compiler)")
    res = reg.resolve("linear", 1, "float32")
    assert res.is_fallback and "cannot provide linear here: C++ kernels did not build" in res.reason


def test_native_ops_cover_the_public_op_contract():
    """Every op the contract (polychip.devices.ops) names has a native reference, and nothing else."""
    from polychip.devices.ops import OPS
    assert set(NATIVE_OPS) == set(OPS)
