"""polychip probe --config FILE [--verbose] [--plugin P]: check a device spec step by step.

Exit status 0 only when every step passes; otherwise the failing step and its reason.
"""
from __future__ import annotations

import sys

from polychip.flags import Parser


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip probe", description=__doc__)
    p.add_argument("--config", "--device-config", dest="config", required=True, help="device spec YAML file")
    p.add_argument("--plugin", action="append", default=[], dest="plugins",
                   help="extra device plugin: module.path or path/to/plugin.py (repeatable)")
    p.add_argument("--verbose", "-v", action="store_true", help="print each step's details")
    args = p.parse_args(argv)
    from polychip.pluginkit.probe import run_probe
    failed = []
    n = 0
    for n, step in enumerate(run_probe(args.config, tuple(args.plugins)), 1):
        mark = "ok  " if step.ok else "FAIL"
        print(f"[{n:>2}] {step.name:<13} {mark} {step.seconds:6.2f}s  {step.summary}", flush=True)
        if args.verbose or not step.ok:
            for line in step.details:
                print(f"      {line}", flush=True)
        if not step.ok:
            failed.append(step)
    if failed:
        names = ", ".join(s.name for s in failed)
        print(f"probe FAILED at step(s): {names}. First failure: {failed[0].name}: {failed[0].summary}",
              file=sys.stderr)
        return 1
    print(f"probe passed: all {n} steps ok")
    return 0
