"""The CPU plugin's C++ fast paths (``csrc/bindings.cpp`` binding the ``_SOURCES`` below: attention,
linears, quantized linears, row ops and the step replay), built once per
machine with torch's extension builder and cached under the torch extensions folder.

``load()`` returns the module, or None with the reason logged once: no compiler, no ninja,
``POLYCHIP_CPU_KERNELS=0``, or a build error. Callers then keep the native PyTorch ops.

The cached library is code loaded into the serving process from a user-writable cache, so it is
pinned like the plugin's files: a package records its sha256 (``library()``, polychip/trust/pins.py)
and, once ``allow_only`` is given the pinned hashes, ``load()`` reads the file, hashes the bytes and
loads those same bytes (from a memfd: nothing can swap the file between the check and the load).
A library the pin does not name (another machine's build) is not loaded, and neither is one built
now: the native ops run instead, said in a warning.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform

import torch

log = logging.getLogger("polychip.devices.cpu")

_DIR = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [os.path.join(_DIR, f) for f in ("bindings.cpp", "decode_attention.cpp", "decode_kv_write.cpp",
                                          "prefill_attention.cpp", "linear.cpp", "quant_linear.cpp", "elementwise.cpp",
                                          "replay.cpp")]
_HEADERS = [os.path.join(_DIR, f) for f in ("common.h", "decode_attention_avx2.h", "kv_kinds.h", "linear_tiles.h",
                                         "simd_exp.h", "w8a8_avx2.h")]
_state: dict = {}          # one build attempt per process: {"module": module or None}
_by_digest: dict = {}      # sha256 of library bytes -> the module loaded from them (each loaded once)
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


def library() -> tuple[str, str]:
    """(build name, path) of this machine's kernel library; the file may not exist yet."""
    name = _name()
    return name, os.path.join(_build_dir(name), name + ".so")


def allow_only(sha256s: dict[str, str] | None) -> None:
    """Load only a library whose bytes hash to the one pinned for its build name (None: any)."""
    if sha256s is None:
        _state.pop("allowed", None)
    else:
        _state["allowed"] = dict(sha256s)
    if _state.get("module") is not None and sha256s is not None and \
            sha256s.get(_state.get("name")) != _state.get("sha256"):
        log.warning("CPU kernels already loaded in this process (sha256 %s) are not the pinned library",
                    str(_state.get("sha256"))[:16])


def loaded_sha256() -> str | None:
    """The sha256 of the library bytes this process loaded, or None."""
    return _state.get("sha256") if _state.get("module") is not None else None


def _import_built(name: str, path: str):
    """The module from an earlier build (the name carries the sources' hash), without the ~2 s that
    cpp_extension.load spends asking ninja whether it is up to date; None if it is not there (or,
    under a pin, not the pinned bytes)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    digest = hashlib.sha256(data).hexdigest()
    allowed = _state.get("allowed")
    if allowed is not None and allowed.get(name) != digest:
        why = "modified since the package pinned it" if name in allowed else "not pinned by the package"
        _state["refused"] = f"the CPU kernel library {path} is {why} (sha256 {digest[:16]}...)"
        return None
    if digest in _by_digest:        # loaded already: a second dlopen (another memfd) would register its ops twice
        return _by_digest[digest]
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        memfd = f"/proc/self/fd/{fd}"       # dlopen reads the origin: the checked bytes, not the file
        loader = importlib.machinery.ExtensionFileLoader(name, memfd)
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader, origin=memfd))
        loader.exec_module(module)
        module.__file__ = module.__spec__.origin = path
        _remember(name, digest, module)
        return module
    except ImportError as e:        # a half-written build: build again
        log.warning("CPU kernels at %s did not import (%s); building again", path, e)
        return None
    finally:
        os.close(fd)


def _remember(name: str, digest: str, module) -> None:
    """The library this process loaded: its sha256 (for pins) and, by it, the module (never dlopened twice)."""
    _state["sha256"], _state["name"] = digest, name
    _by_digest[digest] = module


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
        if "refused" in _state:
            return _unavailable(_state["refused"], logging.WARNING)
        if _state["module"] is None and "allowed" in _state:
            return _unavailable("the package pins no CPU kernel library built here (none is built under a pin)",
                                logging.WARNING)
        if _state["module"] is None:
            log.info("building CPU kernels (once per machine; about a minute)")
            _state["module"] = cpp_extension.load(name, _SOURCES, extra_cflags=_FLAGS, build_directory=folder,
                                                  verbose=False)
            with open(os.path.join(folder, name + ".so"), "rb") as f:   # known by its bytes, as an import is
                _remember(name, hashlib.sha256(f.read()).hexdigest(), _state["module"])
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
