"""polychip conformance --device NAME [--plugin P] [--device-config FILE] [--check NAME]: the
plugin-author kit from the command line, one line per check.

Exit status 0 when no check fails (skipped checks do not apply to the device and are not failures).
"""
from __future__ import annotations

import logging
import sys

from polychip.flags import Parser


def main(argv: list[str]) -> int:
    from polychip.pluginkit import conformance
    p = Parser(prog="polychip conformance", description=__doc__)
    p.add_argument("--device", required=True, help="the plugin's device: <plugin>[:index]")
    p.add_argument("--plugin", action="append", default=[], dest="plugins",
                   help="plugin to load: module.path, package or path/to/plugin.py (repeatable)")
    p.add_argument("--device-config", default=None, help="device spec YAML applied to the device")
    p.add_argument("--check", action="append", default=[], dest="checks", choices=list(conformance.CHECKS),
                   help="run only this check (repeatable; default: all)")
    args = p.parse_args(argv)
    logging.basicConfig(level="WARNING", stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    target = conformance.Target(args.device, tuple(args.plugins), args.device_config)
    failed, n = [], 0
    for n, r in enumerate(conformance.results(target, args.checks or None), 1):
        mark = {"pass": "ok  ", "fail": "FAIL", "skip": "skip"}[r.status]
        print(f"[{n:>2}] {r.name:<18} {mark} {r.seconds:6.2f}s  {r.message}", flush=True)
        if r.status == "fail":
            failed.append(r.name)
    if failed:
        print(f"conformance FAILED: {len(failed)} of {n} checks ({', '.join(failed)})", file=sys.stderr)
        return 1
    print(f"conformance passed: {n} checks on {args.device}")
    return 0
