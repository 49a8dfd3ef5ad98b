"""polychip telemetry: what a router measures, for the operator's terminal.

  polychip telemetry metrics [--filter device_type==simxpu] [--filter model!=tiny] [--name ttft]
  polychip telemetry devices

``metrics`` reads the router's Prometheus ``/metrics`` (parsed with prometheus_client) and prints
one row per sample whose labels pass every --filter (``==`` or ``=`` equal, ``!=`` not equal);
``devices`` prints ``/admin/devices``: each device, its memory, and the workloads on it.
Both take --url (env POLYCHIP_ROUTER_URL) and --api-key (env POLYCHIP_API_KEY).
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from prometheus_client.parser import text_string_to_metric_families

from polychip.commands.router_client import Admin, AdminError, add_router_flags
from polychip.commands.workload import table
from polychip.flags import Parser

_FILTER = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(==|!=|=)(.*)$")


def parse_filter(text: str) -> tuple[str, bool, str]:
    """'device_type==simxpu' -> ('device_type', True, 'simxpu'); '!=' gives False."""
    m = _FILTER.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL==VALUE or LABEL!=VALUE, "
                                         "e.g. device_type==simxpu")
    return m.group(1), m.group(2) != "!=", m.group(3)


def passes(labels: dict, filters: list[tuple[str, bool, str]]) -> bool:
    return all((labels.get(k) == v) == equal for k, equal, v in filters)


def samples(text: str, filters, name: str | None) -> list[tuple[str, dict, float]]:
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (name is None or name in s.name) and passes(s.labels, filters):
                out.append((s.name, s.labels, s.value))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="polychip telemetry", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="view", required=True)
    m = sub.add_parser("metrics", help="the router's metrics, filtered by label")
    m.add_argument("--filter", action="append", default=[], type=parse_filter, metavar="LABEL==VALUE",
                   help="keep samples whose label matches (repeatable: all must hold)")
    m.add_argument("--name", default=None, help="keep metrics whose name contains this")
    d = sub.add_parser("devices", help="each device of the router's host and what runs on it")
    for sp in (m, d):
        add_router_flags(sp)
        sp.add_argument("--json", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    admin = Admin(args.url, args.api_key)
    try:
        return metrics(admin, args) if args.view == "metrics" else devices(admin, args)
    except AdminError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def metrics(admin: Admin, args) -> int:
    rows = samples(admin.call("GET", "/metrics").text, args.filter, args.name)
    if args.json:
        print(json.dumps([{"name": n, "labels": labels, "value": v} for n, labels, v in rows], indent=2))
    else:
        print(table(["METRIC", "LABELS", "VALUE"],
                    [[n, ",".join(f"{k}={v}" for k, v in sorted(labels.items())), f"{v:g}"] for n, labels, v in rows]))
    return 0


def devices(admin: Admin, args) -> int:
    hosts = admin.json("GET", "/admin/devices")["hosts"]
    if args.json:
        print(json.dumps(hosts, indent=2))
        return 0
    gib = lambda b: "-" if b is None else f"{b / 2**30:.1f}"   # noqa: E731
    for h in hosts:
        error = f"  error: {h['error']}" if h["error"] else ""
        print(f"host {h['host']} ({h['hostname']})  router {h['router']}{error}")
        rows = [[d["device"], d["name"], "ready" if d["ready"] else f"not ready: {d['reason']}",
                 f"{gib(d['memory_free'])}/{gib(d['memory_total'])}", ",".join(d["dtypes"]),
                 ",".join(d["workloads"]) or "-"] for d in h["devices"]]
        print(table(["DEVICE", "NAME", "STATE", "FREE/TOTAL GiB", "DTYPES", "WORKLOADS"], rows, indent=2))
        for p in h["plugins"]:
            if not p["loaded"]:
                print(f"  plugin {p['name']} not loaded: {p['reason']}")
    return 0
