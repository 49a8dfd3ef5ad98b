"""Helpers for the package tests: small synthetic packages made by the real assembler, and tar
surgery to make the broken and hostile ones."""
from __future__ import annotations

import io
import os
import tarfile

from polychip.trust import keys as signing
from polychip.package.pack import assemble

FILES = {"config.json": b'{"a": 1}\n', "plan.json": b'{"fusions": [], "ops": []}\n',
         "model.safetensors": os.urandom(3 * 2**20 + 17)}      # more than one 1 MiB hashing chunk


def fields(device_types=("cpu",), plugin_api=1, device_versions=None, versions=None) -> dict:
    """Manifest fields for a package built on this machine's CPU (or with ``versions``)."""
    from polychip.devices.discovery import open_device
    from polychip.package.compat import current_versions
    if versions is None:
        plugin = open_device("cpu")
        versions = current_versions(plugin)
        plugin.destroy()
    versions = dict(versions, plugin_api=plugin_api)
    if device_versions is not None:
        versions["device"] = device_versions
    return {"model": {"source": "synthetic"}, "target": {"device_types": list(device_types)}, "versions": versions}


def synthetic_package(folder, files: dict[str, bytes] = FILES, key=None, name="p.pcpkg", extra: dict | None = None,
                      **field_args) -> str:
    """A package of ``files`` written by polychip's own assembler (signed with ``key``'s private
    file when given; ``extra``: more manifest fields, e.g. release or plugin_pin)."""
    staging = os.path.join(folder, f"staging-{name}")
    os.makedirs(staging)
    for n, data in files.items():
        with open(os.path.join(staging, n), "wb") as f:
            f.write(data)
    out = os.path.join(folder, name)
    private = signing.load_private_key(key) if key else None
    assemble(staging, list(files), out, {**fields(**field_args), **(extra or {})}, private)
    return out


def read_members(path: str) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else None) for m in tar.getmembers()]


def write_members(path: str, members) -> str:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, None


def plain(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    return info, data
