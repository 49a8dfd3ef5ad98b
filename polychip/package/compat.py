"""Does a package fit this device? Device type must match and the plugin API version be compatible
(the same major version, the package's minor no newer than the plugin's; else refused);
the version matrix (polychip, torch, plugin, and what the plugin's ``versions()`` reports) is
compared entry by entry: each mismatch a warning, or a refusal with ``--strict-versions``."""
from __future__ import annotations

from polychip.version import __version__ as polychip_version
from polychip.package.manifest import PackageError


def _api(version) -> tuple[int, int] | str:
    """An API version as (major, minor), so that 1 and "1.0" compare equal; as given if unreadable."""
    from polychip.devices.plugin import parse_api_version   # here: polychip.devices loads torch (see current_versions)
    try:
        return parse_api_version(version)
    except ValueError:
        return str(version)


def current_versions(plugin) -> dict:
    """The version matrix of this process on ``plugin`` (initialised), as a manifest records it."""
    import torch        # here, so that verifying a file (`polychip verify --skip-device`) never loads torch

    from polychip.devices import boundary
    return {"polychip": polychip_version, "torch": torch.__version__, "plugin_api": plugin.api_version,
            "plugin": f"{plugin.name} {plugin.plugin_version}", "device": boundary.versions(plugin)}


def version_mismatches(built: dict, now: dict) -> list[str]:
    """One line per entry that differs: '<entry>: package built with X, this device has Y'."""
    out = []
    for key in ("polychip", "torch", "plugin"):
        if built.get(key) != now.get(key):
            out.append(f"{key}: package built with {built.get(key)!r}, this machine has {now.get(key)!r}")
    was, has = built.get("device") or {}, now.get("device") or {}
    for key in sorted(set(was) | set(has)):
        if was.get(key) != has.get(key):
            out.append(f"{key}: package built with {was.get(key, '(none)')!r}, this device has "
                       f"{has.get(key, '(none)')!r}")
    return out


def check_target(manifest: dict, plugin, strict_versions: bool, source: str) -> list[str]:
    """Refuse a package for another device type or plugin API version; return the version warnings
    (or refuse them too with ``strict_versions``)."""
    types = manifest["target"]["device_types"]
    here = f"{plugin.name}:{plugin.index}"
    if plugin.name not in types:
        raise PackageError(f"{source}: built for device type(s) {types}; this device is {here}. Pack it again "
                           f"with --target-device {plugin.name}", layer="hardware")
    api = manifest["versions"]["plugin_api"]
    built, here_api = _api(api), _api(plugin.api_version)
    # the plugin API's rule: a plugin runs what was built for its major version at its minor or older
    if isinstance(built, str) or isinstance(here_api, str) or built[0] != here_api[0] or built[1] > here_api[1]:
        raise PackageError(f"{source}: built for plugin API version {api}; the {plugin.name} plugin here "
                           f"implements API version {plugin.api_version}", layer="plugin")
    mismatches = version_mismatches(manifest["versions"], current_versions(plugin))
    if mismatches and strict_versions:
        raise PackageError(f"{source}: version mismatch on {here} (--strict-versions): " + "; ".join(mismatches))
    return mismatches
