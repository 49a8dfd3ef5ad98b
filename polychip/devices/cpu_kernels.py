"""The CPU plugin's C++ fast paths (``cpu_kernels.cpp`` binding ``cpu_attention.cpp``,
``cpu_linear.cpp`` and ``cpu_elementwise.cpp``), built once per machine with torch's
extension builder and cached under the torch extensions folder.

``load()`` returns the module, or None with the reason logged once: no compiler, no ninja,
``POLYCHIP_CPU_KERNELS=0``, or a build error. Callers then keep the native PyTorch ops.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform

import torch

log = logging.getLogger("polychip.devices.cpu")

_DIR = os.path.dirname(__file__)
_SOURCES = [os.path.join(_DIR, f) for f in ("cpu_kernels.cpp", "cpu_attention.cpp", "cpu_linear.cpp",
                                                       "cpu_elementwise.cpp")]
_HEADERS = [os.path.join(_DIR, "cpu_common.h")]
_state: dict = {}          # one build attempt per process: {"module": module or None}
# -fopenmp, not just -fopenmp-simd: without _OPENMP, ATen's at::parallel_for compiles to a serial loop
# (GOMP_* then resolve to torch's own libgomp, a dependency of libtorch_cpu)
_FLAGS = ["-O3", "-ffast-math", "-fopenmp",
          "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"]


def enabled() -> bool:
    return os.environ.get("POLYCHIP_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _name() -> str:
    """A build name per source text, flags, machine and torch version (-march=native binds it to the CPU)."""
    key = b""
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            key += f.read()
    key += f"{platform.machine()}|{platform.processor()}|{torch.__version__}|{_FLAGS}".encode()
    return "polychip_cpu_kernels_" + hashlib.sha256(key).hexdigest()[:12]


def load():
    """The compiled module, or None (the reason logged once and kept in ``unavailable_reason()``)."""
    if "module" in _state:
        return _state["module"]
    _state["module"] = None
    if not enabled():
        return _unavailable("CPU kernels off (POLYCHIP_CPU_KERNELS=0)")
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return _unavailable(f"CPU kernels are not built for {platform.machine()}")
    try:
        from torch.utils import cpp_extension
        log.info("loading CPU kernels (the first load on a machine compiles them: about a minute)")
        _state["module"] = cpp_extension.load(_name(), _SOURCES, extra_cflags=_FLAGS, verbose=False)
    except Exception as e:  # a missing compiler or ninja must only cost speed, never correctness
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return _unavailable(f"CPU kernels did not build ({type(e).__name__}: {first})", logging.WARNING)
    return _state["module"]


def _unavailable(reason: str, level: int = logging.INFO):
    _state["reason"] = reason
    log.log(level, "%s; using native PyTorch ops", reason)
    return None


def unavailable_reason() -> str:
    return _state.get("reason", "")
