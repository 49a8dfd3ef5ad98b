"""A plugin pinned by the package it was planned with: its distribution's name and version and the
sha256 of each of its installed files, recorded in the (signed) manifest at pack time and checked
against what is installed when the package is opened.

The files come from the distribution's RECORD (``importlib.metadata``), plus any file found in the
plugin's package folder that RECORD does not list (an added module). A plugin with no installed
distribution (a ``--plugin path.py``), or an editable install whose RECORD lists no sources, is
pinned by the files of its package folder, and the manifest says which (``installed``).
Byte-code caches (``__pycache__``) are not pinned: they are made on this host.

A plugin that loads compiled code from outside its installed files (the CPU plugin's kernel
library, built per machine into the torch extensions cache) lists it with ``compiled_libraries()``
({build name: path}); the pin records each one's sha256 under ``compiled``, and when the package is
opened a library with a pinned name and other bytes is refused like a modified file, and the
plugin is told (``pin_libraries``) to load only the pinned bytes.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import time

from polychip.trust.store import TrustError, override

PIN_SUFFIXES = (".py", ".so", ".pyd", ".yaml", ".yml", ".json", ".txt", ".pth")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _package_dir(plugin) -> tuple[str, str]:
    """(the top-level import name, its folder or file) of the plugin's class."""
    top = type(plugin).__module__.split(".")[0]
    mod = sys.modules[top]
    paths = list(getattr(mod, "__path__", []))
    return top, paths[0] if paths else mod.__file__


def _walk(root: str, base: str) -> dict[str, str]:
    """{path relative to ``base``: sha256} of the pinned files under ``root`` (a folder or a file)."""
    if os.path.isfile(root):
        return {os.path.relpath(root, base): _sha256(root)}
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(PIN_SUFFIXES):
                full = os.path.join(folder, name)
                out[os.path.relpath(full, base)] = _sha256(full)
    return out


def _owns(dist, top: str) -> bool:
    listed = dist.read_text("top_level.txt")
    if listed is not None:
        return top in listed.split()
    return any(str(f).split("/")[0] in (top, f"{top}.py") for f in dist.files or [])


def _distribution(top: str):
    """The installed distribution that provides the import name ``top``, or None. First the one
    named like it (a lookup); else every distribution's top-level names (a scan: ~0.7 s here)."""
    try:
        dist = importlib.metadata.distribution(top)
        if _owns(dist, top):
            return dist
    except importlib.metadata.PackageNotFoundError:
        pass
    names = importlib.metadata.packages_distributions().get(top, [])
    return importlib.metadata.distribution(names[0]) if len(names) == 1 else None


def installed_files(plugin) -> dict:
    """What is installed now for ``plugin``, in the pin's shape (without the plugin name)."""
    top, root = _package_dir(plugin)
    base = os.path.dirname(root)
    dist = _distribution(top)
    files = _walk(root, base)
    if dist is None:
        return {"distribution": None, "version": None, "installed": "path", "files": files}
    recorded = {str(f): f for f in (dist.files or []) if f.hash is not None}
    owned = {p: f for p, f in recorded.items() if p.split("/")[0] == top or p == f"{top}.py"}
    if not owned:
        return {"distribution": dist.metadata["Name"], "version": dist.version, "installed": "editable",
                "files": files}
    for p, f in owned.items():          # RECORD's files, hashed now (never RECORD's own hashes)
        full = str(dist.locate_file(f))
        files[p] = _sha256(full) if os.path.isfile(full) else "missing"
    return {"distribution": dist.metadata["Name"], "version": dist.version, "installed": "wheel", "files": files}


def compiled_of(plugin) -> dict[str, str]:
    """{build name: sha256} of the compiled libraries the plugin loads from outside its files."""
    listed = getattr(plugin, "compiled_libraries", None)
    return {name: _sha256(path) for name, path in (listed() if listed else {}).items()}


def pin_of(plugin) -> dict:
    """The pin a package records for the plugin it was planned on."""
    return {"plugin": plugin.name, **installed_files(plugin), "compiled": compiled_of(plugin)}


def compiled_problems(pin: dict, plugin) -> list[str]:
    """A pinned compiled library (same build name) whose bytes differ now."""
    want = pin.get("compiled") or {}
    return [f"compiled library {name}: modified (sha256 {sha[:16]}..., the package pins {want[name][:16]}...)"
            for name, sha in compiled_of(plugin).items() if name in want and want[name] != sha]


def pin_problems(pin: dict, now: dict) -> list[str]:
    """One line per difference between the pin and what is installed."""
    out = []
    for key in ("distribution", "version"):
        if pin.get(key) != now.get(key):
            out.append(f"{key}: the package pins {pin.get(key)!r}, installed is {now.get(key)!r}")
    want, have = pin.get("files", {}), now["files"]
    for name in sorted(set(want) | set(have)):
        if name not in have or have[name] == "missing":
            out.append(f"{name}: missing (pinned by the package)")
        elif name not in want:
            out.append(f"{name}: extra file, not in the package's pin")
        elif want[name] != have[name]:
            out.append(f"{name}: modified (sha256 {have[name][:16]}..., the package pins {want[name][:16]}...)")
    return out


def check_pin(pin: dict | None, plugin, source: str, allow_modified: bool) -> float:
    """Refuse (TrustError naming each file) when the installed plugin is not the pinned one;
    ``allow_modified`` turns that into a TRUST OVERRIDE warning. Returns the seconds it took."""
    t0 = time.perf_counter()
    if pin is None:
        return 0.0
    if pin.get("plugin") != plugin.name:
        raise TrustError(f"{source}: pins plugin {pin.get('plugin')!r}, the device here is {plugin.name!r}")
    now = installed_files(plugin)
    problems = pin_problems(pin, now) + compiled_problems(pin, plugin)
    where = f"plugin {plugin.name!r} ({now['distribution'] or 'no distribution'} {now['version'] or ''}, " \
            f"{_package_dir(plugin)[1]})"
    if problems:
        msg = f"{source}: {where} differs from the package's pin: " + "; ".join(problems[:10]) + \
            (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        if not allow_modified:
            raise TrustError(msg + " (--allow-modified-plugin to load it anyway)", layer="plugin")
        override(msg + ": loaded by --allow-modified-plugin")
    if hasattr(plugin, "pin_libraries"):     # only the pinned bytes load (any, once overridden)
        plugin.pin_libraries(None if problems else dict(pin.get("compiled") or {}))
    return time.perf_counter() - t0
