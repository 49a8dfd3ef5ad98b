"""polychip doctor [--package PKG] [--device-config SPEC ...] [--trust-store S] [--port N ...]:
check this host before serving, one finding a line with its fix: the trust store (keys expired
or expiring within 30 days), the specs' signatures, the package's signature, release, plugin pin
and version matrix, the device plugins and their devices, the op baselines this host holds (and
whether each device's version matrix now has one: `polychip bench ops`), seccomp, and the ports. Exit status 1
when any finding is a FAIL."""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

from polychip.errors import PolychipError
from polychip.flags import Parser, add_config_args, config_from_args

EXPIRY_WARNING_DAYS = 30


@dataclass
class Finding:
    status: str             # ok, warn, FAIL
    what: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<4}  {self.what}: {self.detail}" + (f"\n      fix: {self.fix}" if self.fix else "")


def _err(e: Exception) -> str:
    return str(e).split("] ", 1)[-1] if isinstance(e, PolychipError) else f"{type(e).__name__}: {e}"


def store_findings(trust) -> tuple[object, list[Finding]]:
    try:
        store = trust.store()
    except PolychipError as e:
        return None, [Finding("FAIL", "trust store", _err(e), "fix trust.yaml (docs/packages.md, Trust chain)")]
    if store is None:
        return None, [Finding("warn", "trust store", "none set: unsigned packages and specs load with a log line",
                              "set --trust-store or $POLYCHIP_TRUST_STORE")]
    out = [Finding("ok", "trust store", f"{store.path}: {len(store.keys)} key(s), {len(store.revoked)} revoked")]
    today = datetime.date.today()
    for k in store.trusted_keys(today):
        if k.problem and k.key is not None:
            out.append(Finding("warn", "key", f"{k.label()} {k.problem}", "remove it from trust.yaml or renew it"))
    for k in store.expiring(EXPIRY_WARNING_DAYS, today):
        out.append(Finding("warn", "key", f"{k.key.label()} expires on {k.not_after} "
                                          f"({(k.not_after - today).days} days)",
                           "sign with a new key (polychip keygen) and add it to trust.yaml before then"))
    return store, out


def spec_findings(specs: list[str], store, trust) -> list[Finding]:
    from polychip.trust.detached import verify_file
    out = []
    for spec in specs:
        try:
            signer = verify_file(spec, store, trust.allow_unsigned, "device spec")
            out.append(Finding("ok" if signer or store is None else "warn", "device spec",
                               f"{spec}: " + (f"signed by {signer}" if signer else "signature not checked")))
        except PolychipError as e:
            out.append(Finding("FAIL", "device spec", _err(e), f"polychip sign {spec} --key KEY (with a store key)"))
    return out


def package_findings(path: str, store, trust, plugins: tuple[str, ...], device_config: str | None) -> list[Finding]:
    from polychip.commands.verify import device_checks, release_check
    from polychip.devices.discovery import open_device
    from polychip.package.reader import scan
    from polychip.trust.pins import check_pin
    trusted = store.trusted_keys() if store is not None else []
    res = scan(path, trusted, store is not None, head_only=True, keep_going=True,
               allow_unsigned=store is not None and trust.allow_unsigned)
    out = [Finding("ok" if c.status == "ok" else "FAIL" if c.status == "FAIL" else "warn", f"package {c.what}",
                   c.detail, "re-sign the package with a key of the trust store" if c.status == "FAIL" else "")
           for c in res.checks]
    if res.manifest is None or not res.ok:
        return out
    if store is not None:
        c = release_check(store, res.manifest, path, trust.allow_downgrade)
        out.append(Finding(c.status, "package release", c.detail, "load a newer release" if c.status == "FAIL" else ""))
    for dtype in res.manifest["target"]["device_types"]:
        try:
            plugin = open_device(dtype, plugins, device_config)
        except PolychipError as e:
            out.append(Finding("FAIL", "package device", _err(e), f"install the {dtype} plugin or its driver"))
            continue
        try:
            check_pin(res.manifest.get("plugin_pin"), plugin, path, trust.allow_modified_plugin)
            out.append(Finding("ok" if res.manifest.get("plugin_pin") else "warn", "plugin pin",
                               f"{plugin.name}: matches the package" if res.manifest.get("plugin_pin")
                               else "the package pins no plugin files", ""))
        except PolychipError as e:
            out.append(Finding("FAIL", "plugin pin", _err(e), "reinstall the plugin wheel the package was made with"))
        finally:
            plugin.destroy()
    for c in device_checks(res.manifest, plugins, device_config, False, path):
        out.append(Finding(c.status, f"package {c.what}", c.detail,
                           "pack again on this version matrix, or install the package's" if c.status != "ok" else ""))
    return out


def device_findings(plugins: tuple[str, ...]) -> list[Finding]:
    from polychip.devices import boundary
    from polychip.devices.discovery import discover_plugins
    out = []
    for rec in discover_plugins(plugins):
        if rec.ok and rec.available:
            try:
                n = len(boundary.devices(rec.plugin))
            except PolychipError as e:
                out.append(Finding("FAIL", "devices", f"{rec.name} ({rec.source}): {_err(e)}",
                                   "the plugin's vendor must fix what it reports (docs/plugin-guide.md, section 3)"))
                continue
            out.append(Finding("ok" if n else "warn", "devices", f"{rec.name} ({rec.source}): {n} device(s)",
                               "" if n else f"check the {rec.name} driver"))
        elif rec.failed_step in ("import", "api_version", "register") or rec.explicit:
            out.append(Finding("FAIL", "devices", rec.describe_failure(), "reinstall the plugin or fix its API version"))
        else:
            out.append(Finding("warn" if rec.name != "cuda" else "ok", "devices",
                               f"{rec.name}: not available here ({rec.reason or rec.failed_step})"))
    return out


def _matrix(versions: dict) -> str:
    dev = versions.get("device") or {}
    return ", ".join(f"{k} {v}" for k, v in dev.items()) + f"; {versions.get('plugin')}, polychip {versions.get('polychip')}"


def _spec_type(path: str) -> str | None:
    from polychip.devices.spec import load_spec
    try:
        return load_spec(path).device_type
    except PolychipError:
        return None


def baseline_findings(plugins: tuple[str, ...], specs: list[str]) -> list[Finding]:
    """The op baselines this host holds (polychip bench ops --save), and for each device they were made on,
    whether its version matrix now has one: a driver upgrade since the last baseline is not yet gated."""
    from polychip.bench import op_baseline
    from polychip.devices.discovery import open_device
    from polychip.package.compat import current_versions
    stored, where = op_baseline.stored(), op_baseline.baseline_dir()
    if not stored:
        return [Finding("ok", "op baselines", f"none in {where}",
                        "before a driver or SDK upgrade: polychip bench ops --device D --save (docs/upgrades.md)")]
    out = [Finding("ok", "op baseline", f"{data['device']}, model {data['model'].get('path') or 'embedded'}: "
                                        f"{_matrix(data['versions'])} (saved {data.get('created')}, {path})")
           for path, data in stored]
    for device in dict.fromkeys(data["device"] for _, data in stored):
        mine = [(p, d) for p, d in stored if d["device"] == device]
        spec = next((s for s in specs if _spec_type(s) == device.partition(":")[0]), None) or mine[0][1].get("spec")
        try:
            plugin = open_device(device, plugins, spec if spec and os.path.exists(spec) else None)
            try:
                now = current_versions(plugin)
            finally:
                plugin.destroy()
        except PolychipError as e:
            out.append(Finding("warn", "op baselines", f"{device}: cannot open it to read its version matrix: {_err(e)}"))
            continue
        match = next((p for p, d in mine if op_baseline.matrix_id(d["versions"]) == op_baseline.matrix_id(now)), None)
        if match is not None:
            out.append(Finding("ok", "op baselines", f"{device}: its version matrix now has a baseline ({match})"))
        else:
            _, newest = mine[0]
            was, has = op_baseline.flat_versions(newest["versions"]), op_baseline.flat_versions(now)
            changed = "; ".join(f"{k} {was.get(k)} -> {has.get(k)}" for k in sorted(set(was) | set(has))
                                if was.get(k) != has.get(k))
            out.append(Finding("warn", "op baselines", f"{device}: no baseline for its version matrix now ({changed})",
                               f"gate it: polychip bench ops --device {device} --baseline (docs/upgrades.md)"))
    return out


def seccomp_finding() -> Finding:
    from polychip.trust.seccomp import unavailable
    why = unavailable()
    return Finding("warn" if why else "ok", "seccomp", why or "serve --seccomp can be applied on this host",
                   "apt-get install libseccomp2; pip install pyseccomp" if why else "")


def port_findings(host: str, ports: list[int]) -> list[Finding]:
    out = []
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            try:
                s.bind((host, port))
                out.append(Finding("ok", "port", f"{host}:{port} is free"))
            except OSError as e:
                out.append(Finding("FAIL", "port", f"{host}:{port}: {e.strerror}",
                                   "stop what listens there or choose another --port"))
    return out


def main(argv: list[str]) -> int:
    from polychip.trust.options import TrustOptions
    p = Parser(prog="polychip doctor", description=__doc__)
    p.add_argument("--package", default=None, help="a .pcpkg to check against this host")
    p.add_argument("--device-config", action="append", default=[], dest="specs", help="device spec (repeatable)")
    p.add_argument("--plugin", action="append", default=[], dest="plugins")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", action="append", type=int, default=[], dest="ports", help="a port to serve on (repeatable)")
    add_config_args(p, TrustOptions)
    args = p.parse_args(argv)
    trust = config_from_args(args, TrustOptions)
    plugins = tuple(args.plugins)
    store, findings = store_findings(trust)
    findings += spec_findings(args.specs, store, trust)
    if args.package:
        findings += package_findings(args.package, store, trust, plugins, args.specs[0] if args.specs else None)
    findings += device_findings(plugins) + baseline_findings(plugins, args.specs) + [seccomp_finding()] + \
        port_findings(args.host, args.ports or [30000])
    for f in findings:
        print(f.line())
    bad = sum(f.status == "FAIL" for f in findings)
    print(f"{'FAILED' if bad else 'ok'}: {bad} failure(s), {sum(f.status == 'warn' for f in findings)} warning(s) "
          f"in {len(findings)} findings")
    return 1 if bad else 0
