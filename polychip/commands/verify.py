"""polychip verify PKG [--trusted-key PUB ...]: check a package without loading it, one line per
check: manifest and format, signature, every file's sha256 and size (streamed), no missing or
extra member, and that this machine has the target device type, plugin API and versions.
Exits 0 only when every check passes (version differences warn unless --strict-versions; an
unchecked signature is 'skip' unless --require-signature)."""
from __future__ import annotations

import resource
import sys
import time

from polychip.commands.common import fail
from polychip.errors import PolychipError
from polychip.flags import Parser, add_config_args, config_from_args
from polychip.package.opening import PackageOptions
from polychip.trust.options import TrustOptions


def device_checks(manifest: dict, plugins: tuple[str, ...], device_config: str | None, strict: bool, path: str):
    """Check lines for the package's target on this machine."""
    from polychip.devices.discovery import open_device
    from polychip.package.compat import check_target
    from polychip.package.manifest import PackageError
    from polychip.package.reader import Check
    checks = []
    for dtype in manifest["target"]["device_types"]:
        try:
            plugin = open_device(dtype, plugins, device_config)
        except PolychipError as e:
            checks.append(Check("FAIL", "device type", f"{dtype} is not usable here: {e}"))
            continue
        try:
            warnings = check_target(manifest, plugin, strict, path)
            checks.append(Check("ok", "device type", f"{dtype} present ({plugin.name} {plugin.plugin_version}, "
                                                     f"plugin API {plugin.api_version})"))
            checks += [Check("warn", "versions", w) for w in warnings]
            if not warnings:
                checks.append(Check("ok", "versions", "the version matrix matches the package's"))
        except PackageError as e:
            checks.append(Check("FAIL", "device", str(e).removeprefix("[framework] ").removeprefix("[hardware] ")
                                .removeprefix("[plugin] ")))
        finally:
            plugin.destroy()
    return checks


def release_check(store, manifest: dict, path: str, allow_downgrade: bool):
    """The package's release number against the highest the trust store has seen (not recorded:
    verify loads nothing)."""
    from polychip.package.reader import Check
    release = manifest.get("release")
    if release is None:
        return Check("warn", "release", "no release number: a downgrade of it cannot be refused")
    try:
        store.check_release(release["name"], release["number"], path, allow_downgrade)
    except PolychipError as e:
        return Check("FAIL", "release", str(e).removeprefix("[config] "))
    return Check("ok", "release", f"{release['name']} release {release['number']}, none newer seen here")


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip verify", description=__doc__)
    p.add_argument("package")
    add_config_args(p, PackageOptions)          # --trusted-key, --require-signature, --strict-versions
    add_config_args(p, TrustOptions)            # --trust-store, --allow-*
    p.add_argument("--plugin", action="append", default=[], dest="plugins")
    p.add_argument("--device-config", default=None, help="device spec YAML for the target device")
    p.add_argument("--skip-device", action="store_true", help="check the file only, not this machine")
    args = p.parse_args(argv)
    from polychip.trust import keys as signing
    from polychip.package.reader import scan
    t0 = time.perf_counter()
    try:
        options = config_from_args(args, PackageOptions)
        trust = config_from_args(args, TrustOptions)
        store = trust.store()
        trusted = [signing.load_trusted_key(k) for k in options.trusted_keys] + \
            (store.trusted_keys() if store is not None else [])
    except PolychipError as e:
        return fail(e)
    res = scan(args.package, trusted, options.require_signature or store is not None, keep_going=True,
               allow_unsigned=store is not None and trust.allow_unsigned)
    if store is not None and res.ok and res.manifest is not None:
        res.checks.append(release_check(store, res.manifest, args.package, trust.allow_downgrade))
    checks = list(res.checks)
    if res.manifest is not None and not args.skip_device and res.ok:
        checks += device_checks(res.manifest, tuple(args.plugins), args.device_config, options.strict_versions,
                                args.package)
    for c in checks:
        print(c.line())
    bad = [c for c in checks if c.status == "FAIL"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{'FAILED' if bad else 'verified'}: {len(checks) - len(bad)} of {len(checks)} checks passed "
          f"[{time.perf_counter() - t0:.2f}s, peak resident memory {peak / 1024:.0f} MiB]", file=sys.stderr)
    return 1 if bad else 0
