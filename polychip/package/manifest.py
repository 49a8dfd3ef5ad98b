"""The package format: member names, ``manifest.json`` (parsed and validated) and its hash."""
from __future__ import annotations

import hashlib
import json
import re

from polychip.errors import PolychipError

FORMAT_VERSION = 1
SUFFIX = ".pcpkg"
MANIFEST, SIGNATURE, PLAN = "manifest.json", "manifest.sig", "plan.json"
MAX_MANIFEST_BYTES = 16 * 2**20          # read whole: it is parsed, and must be small
MAX_SIGNATURE_BYTES = 64 * 2**10
# data files only: nothing in a package is executed or unpickled
DATA_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class PackageError(PolychipError):
    """A package cannot be used: it does not verify, is unsafe to extract, or does not fit this device."""


def name_problem(name: str) -> str:
    """Why ``name`` cannot be a package member ("" when it can): members are plain data-file names
    in one folder, so none can escape the extraction folder."""
    if name.startswith("/") or re.match(r"[A-Za-z]:[\\/]", name):
        return "an absolute path (escapes the extraction folder)"
    if ".." in re.split(r"[\\/]", name):
        return "a '..' path (escapes the extraction folder)"
    if "/" in name or "\\" in name:
        return "a path inside a folder; members are plain file names"
    if not _PLAIN_NAME.fullmatch(name):
        return "not a plain file name (letters, digits, '.', '_', '-')"
    if not name.endswith(DATA_SUFFIXES):
        return f"not a data file (allowed: {', '.join(DATA_SUFFIXES)}); nothing in a package is executed"
    return ""


def manifest_sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def parse_manifest(raw: bytes, source: str) -> dict:
    """The validated manifest from its bytes; every problem is a PackageError naming ``source``."""
    where = f"{source}: {MANIFEST}"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise PackageError(f"{where}: expected a JSON object, got {type(data).__name__}")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise PackageError(f"{where}: unknown format version {version!r}; this polychip reads format "
                           f"version {FORMAT_VERSION}")
    files = data.get("files")
    if not isinstance(files, list) or not files:
        raise PackageError(f"{where}: 'files' must be a non-empty list")
    seen = set()
    for i, entry in enumerate(files):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])
                and isinstance(entry.get("size"), int) and not isinstance(entry["size"], bool) and entry["size"] >= 0):
            raise PackageError(f"{where}: files[{i}] must be {{name, sha256 (64 hex digits), size (bytes)}}")
        name = entry["name"]
        why = name_problem(name) or ("a reserved name" if name in (MANIFEST, SIGNATURE) else "")
        if why:
            raise PackageError(f"{where}: files[{i}] {name!r} is {why}")
        if name in seen:
            raise PackageError(f"{where}: {name!r} is listed twice")
        seen.add(name)
    target = data.get("target")
    if not (isinstance(target, dict) and isinstance(target.get("device_types"), list) and target["device_types"]
            and all(isinstance(t, str) for t in target["device_types"])):
        raise PackageError(f"{where}: 'target.device_types' must be a non-empty list of device type names")
    versions = data.get("versions")
    api = versions.get("plugin_api") if isinstance(versions, dict) else None
    if isinstance(api, bool) or not isinstance(api, (int, str)):
        raise PackageError(f"{where}: 'versions.plugin_api' must be a plugin API version such as \"1.2\" (or 1)")
    _check_trust_fields(data, where)
    return data


def _check_trust_fields(data: dict, where: str) -> None:
    """The optional release number (no downgrade) and plugin pin (polychip/trust)."""
    release = data.get("release")
    if release is not None and not (isinstance(release, dict) and isinstance(release.get("name"), str)
                                    and release["name"] and isinstance(release.get("number"), int)
                                    and not isinstance(release["number"], bool) and release["number"] >= 0):
        raise PackageError(f"{where}: 'release' must be {{name (the model's name), number (an integer >= 0)}}")
    pin = data.get("plugin_pin")
    if pin is not None and not (isinstance(pin, dict) and isinstance(pin.get("plugin"), str)
                                and isinstance(pin.get("files"), dict)
                                and all(isinstance(k, str) and isinstance(v, str) for k, v in pin["files"].items())
                                and isinstance(pin.get("compiled", {}), dict)
                                and all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in pin.get("compiled", {}).items())):
        raise PackageError(f"{where}: 'plugin_pin' must be {{plugin, distribution, version, installed, "
                           "files: {path: sha256}, compiled: {build name: sha256}}")


def dump_manifest(data: dict) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")
