"""Helpers for the trust-chain tests: a site trust store on disk, and a plugin installed the way
pip installs a wheel (a package folder plus its .dist-info with METADATA and RECORD)."""
from __future__ import annotations

import base64
import datetime
import hashlib
import os
import sys

import yaml

from polychip.trust import keys as signing

PLUGIN_SOURCE = '''"""A CPU plugin under another name, installed as a wheel for the pin tests."""
from polychip.devices.cpu.plugin import CpuPlugin


class PinnedCpu(CpuPlugin):
    name = "pinnedcpu"
'''


def trust_store(folder, keys: dict[str, str], revoked: dict[str, str] = None,
                not_after: dict[str, datetime.date] = None) -> str:
    """A trust store folder holding ``keys`` (name -> public key file): each valid for a year
    unless ``not_after`` says otherwise; ``revoked``: name -> reason."""
    store = os.path.join(folder, "trust")
    os.makedirs(store, exist_ok=True)
    year = datetime.date.today() + datetime.timedelta(days=365)
    entries, gone = [], []
    for name, pub in keys.items():
        entries.append({"file": os.path.abspath(pub), "not_after": (not_after or {}).get(name, year)})
    for name, reason in (revoked or {}).items():
        gone.append({"key_id": signing.load_trusted_key(keys[name]).key_id, "reason": reason})
    with open(os.path.join(store, "trust.yaml"), "w") as f:
        yaml.safe_dump({"keys": entries, "revoked": gone}, f)
    return store


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install_wheel_plugin(site: str, package: str = "pinnedcpu_plugin", version: str = "1.0") -> str:
    """Write ``package`` (one module) and its dist-info into the folder ``site`` and put it on
    sys.path; returns the plugin target for ``--plugin``."""
    pkg = os.path.join(site, package)
    os.makedirs(pkg)
    files = {f"{package}/__init__.py": PLUGIN_SOURCE.encode(), f"{package}/extra.py": b"VALUE = 1\n"}
    for rel, data in files.items():
        with open(os.path.join(site, rel), "wb") as f:
            f.write(data)
    info = os.path.join(site, f"{package}-{version}.dist-info")
    os.makedirs(info)
    meta = f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {version}\n"
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(meta)
    with open(os.path.join(info, "top_level.txt"), "w") as f:
        f.write(package + "\n")
    rows = [f"{rel},{_record_hash(data)},{len(data)}" for rel, data in files.items()]
    rows += [f"{package}-{version}.dist-info/METADATA,{_record_hash(meta.encode())},{len(meta)}",
             f"{package}-{version}.dist-info/RECORD,,"]
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("\n".join(rows) + "\n")
    sys.path.insert(0, site)
    return f"{package}:PinnedCpu"
