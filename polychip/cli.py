"""``polychip <command> ...``: each command lives in ``polychip/commands/<name>.py`` and is
imported only when run, so one broken command never breaks the others."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": "start the OpenAI-compatible server",
    "router": "one OpenAI endpoint over many replicas (health, failover, canary)",
    "generate": "generate text offline from a prompt",
    "batch": "run an OpenAI batch file (JSONL) through the engine in-process",
    "devices": "list device plugins and their devices",
    "probe": "check a device spec step by step before serving",
    "conformance": "run the plugin-author kit against a device, one line per check",
    "coverage": "show which op implementation a model uses on a device",
    "plan": "split a model over pipeline stages on unlike devices: layers, memory, step times, throughput",
    "workload": "submit, list, describe, tail and delete models served on devices (via a router)",
    "telemetry": "a router's metrics, filterable by label (e.g. --filter device_type==simxpu), and devices",
    "bench": "benchmarks: serving, compare, peers",
    "pack": "write a signed offline model package (.pcpkg)",
    "verify": "check a package's signature, hashes and target without loading it",
    "inspect": "show a package's devices, plan, versions and files",
    "keygen": "make an Ed25519 key pair for signing packages",
    "trust": "write a site trust store: init, add-key, revoke",
    "sign": "write a detached signature beside a YAML file (device spec, deployment file)",
    "doctor": "check this host: versions, trust store, signatures, plugins, devices, ports",
}


def usage() -> str:
    rows = "\n".join(f"  {name:<10} {text}" for name, text in COMMANDS.items())
    return f"usage: polychip <command> [options]\n\ncommands:\n{rows}\n\n`polychip <command> --help` for options."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"polychip: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"polychip.commands.{name}")
    try:
        rc = module.main(rest) or 0
        sys.stdout.flush()
        return rc
    except BrokenPipeError:      # `polychip devices --json | head`: the reader left; not an error
        sys.stdout = None        # no flush at exit onto the closed pipe
        return 0


if __name__ == "__main__":
    sys.exit(main())
