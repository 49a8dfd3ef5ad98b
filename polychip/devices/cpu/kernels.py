"""The CPU plugin's C++ fast paths (``csrc/bindings.cpp`` binding ``decode_attention.cpp``,
``prefill_attention.cpp``, ``linear.cpp`` and ``elementwise.cpp``), built once per
machine with torch's extension builder and cached under the torch extensions folder.

``load()`` returns the module, or None with the reason logged once: no compiler, no ninja,
``POLYCHIP_CPU_KERNELS=0``, or a build error. Callers then keep the native PyTorch ops.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform

import torch

log = logging.getLogger("polychip.devices.cpu")

_DIR = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [os.path.join(_DIR, f) for f in ("bindings.cpp", "decode_attention.cpp", "prefill_attention.cpp",
                                          "linear.cpp", "quant_linear.cpp", "elementwise.cpp", "replay.cpp")]
_HEADERS = [os.path.join(_DIR, "common.h")]
_state: dict = {}          # one build attempt per process: {"module": module or None}
# -fopenmp, not just -fopenmp-simd: without _OPENMP, ATen's at::parallel_for compiles to a serial loop
# (GOMP_* then resolve to torch's own libgomp, a dependency of libtorch_cpu). -fno-finite-math-only:
# the attention kernels mark empty pieces and masked scores with -inf, which fast-math may assume away
_FLAGS = ["-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp",
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


def _build_dir(name: str) -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    path = os.path.join(root, "polychip", name)
    os.makedirs(path, exist_ok=True)
    return path


def _import_built(name: str, path: str):
    """The module from an earlier build (the name carries the sources' hash), without the ~2 s that
    cpp_extension.load spends asking ninja whether it is up to date; None if it is not there."""
    if not os.path.exists(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError as e:        # a half-written build: build again
        log.warning("CPU kernels at %s did not import (%s); building again", path, e)
        return None


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
        name = _name()
        folder = _build_dir(name)
        _state["module"] = _import_built(name, os.path.join(folder, name + ".so"))
        if _state["module"] is None:
            log.info("building CPU kernels (once per machine; about a minute)")
            _state["module"] = cpp_extension.load(name, _SOURCES, extra_cflags=_FLAGS, build_directory=folder,
                                                  verbose=False)
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
