"""polychip workload: models served on devices, through a router's admin API.

  polychip workload submit --model PATH|PKG.pcpkg (--device simxpu:0 | --device-type simxpu)
                           [--name NAME] [--tp-size N] [--quantization int8] [--kv-cache-dtype fp8_e4m3]
                           [--version v2] [--wait] [-- more polychip serve flags]
  polychip workload list [--model NAME] [--device-type TYPE]
  polychip workload describe ID
  polychip workload logs ID [--tail N] [--follow]
  polychip workload delete ID [--wait]

Every command takes --url (env POLYCHIP_ROUTER_URL) and --api-key (env POLYCHIP_API_KEY).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from polychip.commands.router_client import Admin, AdminError, add_router_flags
from polychip.flags import Parser

WAIT_POLL = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="polychip workload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("submit", help="place a model on a device and start it (returns its id)")
    s.add_argument("--model", required=True, help="model dir, GGUF file or .pcpkg package (on the router's host)")
    s.add_argument("--name", default=None, help="served model name (default: the path's stem)")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--device", help="a device, e.g. simxpu:0 or cpu")
    where.add_argument("--device-type", help="any free capable device of this type, e.g. simxpu")
    s.add_argument("--tp-size", type=int, default=1)
    s.add_argument("--dtype", default="auto")
    s.add_argument("--quantization", default=None)
    s.add_argument("--kv-cache-dtype", default="auto")
    s.add_argument("--version", default="default", help="version label (for canary weights)")
    s.add_argument("--wait", action="store_true", help="return when it is ready (or failed)")
    s.add_argument("--timeout", type=float, default=600, help="--wait's limit in seconds")
    ls = sub.add_parser("list", help="workloads, filterable by model and device type")
    ls.add_argument("--model", default=None)
    ls.add_argument("--device-type", default=None)
    d = sub.add_parser("describe", help="one workload: devices, events, load/compile time, first-token latency")
    d.add_argument("id")
    lg = sub.add_parser("logs", help="its replica's own log")
    lg.add_argument("id")
    lg.add_argument("--tail", type=int, default=100, help="last N lines (default 100)")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing what it writes")
    rm = sub.add_parser("delete", help="drain (in-flight requests finish), then stop; the devices are free")
    rm.add_argument("id")
    rm.add_argument("--wait", action="store_true", help="return when it has stopped")
    rm.add_argument("--timeout", type=float, default=600)
    for sp in (s, ls, d, lg, rm):
        add_router_flags(sp)
    for sp in (s, ls, d, rm):
        sp.add_argument("--json", action="store_true", help="print the router's JSON")
    return p


def main(argv: list[str]) -> int:
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(argv)
    admin = Admin(args.url, args.api_key)
    try:
        return VERBS[args.verb](admin, args, serve_args)
    except AdminError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def submit(admin: Admin, args, serve_args: list[str]) -> int:
    body = {"model": args.model, "name": args.name, "device": args.device, "device_type": args.device_type,
            "tp_size": args.tp_size, "dtype": args.dtype, "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype, "version": args.version, "serve_args": serve_args}
    w = admin.json("POST", "/admin/workloads", json={k: v for k, v in body.items() if v is not None})
    if args.wait:
        w = wait_for(admin, w["id"], ("ready", "failed"), args.timeout)
    print(json.dumps(w, indent=2) if args.json else f"{w['id']}  {w['status']}  {w['model']} on "
          f"{', '.join(w['devices'])} ({w['host']})")
    return 0 if w["status"] != "failed" else 1


def wait_for(admin: Admin, wid: str, states: tuple[str, ...], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        w = admin.json("GET", f"/admin/workloads/{wid}")
        if w["status"] in states:
            return w
        if time.monotonic() > deadline:
            raise AdminError(f"workload {wid} is still {w['status']} after {timeout:g}s")
        time.sleep(WAIT_POLL)


def listing(admin: Admin, args, _) -> int:
    params = {k: v for k, v in (("model", args.model), ("device_type", args.device_type)) if v}
    rows = admin.json("GET", "/admin/workloads", params=params)["data"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(["ID", "MODEL", "VERSION", "HOST", "DEVICES", "STATUS", "RESTARTS", "AGE"],
                [[w["id"], w["model"], w["version"], w["host"], ",".join(w["devices"]), w["status"],
                  str(w["restarts"]), age(w["age_s"])] for w in rows]))
    return 0


def describe(admin: Admin, args, _) -> int:
    w = admin.json("GET", f"/admin/workloads/{args.id}")
    if args.json:
        print(json.dumps(w, indent=2))
        return 0
    secs = lambda v: "-" if v is None else f"{v:.2f}s"   # noqa: E731
    fields = [("id", w["id"]), ("model", f"{w['model']}  ({w['model_path']})"), ("version", w["version"]),
              ("status", w["status"]), ("host", w["host"]), ("target_device", w["target_device"]),
              ("devices", ", ".join(w["devices"])), ("url", w["url"] or "-"), ("restarts", w["restarts"]),
              ("age", age(w["age_s"])), ("load time", secs(w["load_s"])), ("compile time", secs(w["compile_s"])),
              ("warm-up time", secs(w["warmup_s"])),
              ("first token", "-" if w["first_token_s"] is None else f"{w['first_token_s'] * 1000:.0f} ms "
                                                                     "(its first request)")]
    print("\n".join(f"{k + ':':<15} {v}" for k, v in fields))
    print("events:")
    print(table(["AT", "EVENT", "DETAIL"], [[e["at"], e["event"], e["detail"]] for e in w["events"]], indent=2))
    return 0


def logs(admin: Admin, args, _) -> int:
    path = f"/admin/workloads/{args.id}/logs"
    if not args.follow:
        sys.stdout.write(admin.call("GET", path, params={"tail": args.tail}).text)
        return 0
    try:
        for text in admin.stream_lines(path, params={"tail": args.tail, "follow": "true"}):
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    return 0


def delete(admin: Admin, args, _) -> int:
    w = admin.json("DELETE", f"/admin/workloads/{args.id}")
    if args.wait:
        w = wait_for(admin, args.id, ("stopped",), args.timeout)
    print(json.dumps(w, indent=2) if args.json else f"{w['id']}  {w['status']}")
    return 0


def age(seconds: float) -> str:
    s = int(seconds)
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def table(head: list[str], rows: list[list[str]], indent: int = 0) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    return "\n".join(" " * indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [head, *rows])


VERBS = {"submit": submit, "list": listing, "describe": describe, "logs": logs, "delete": delete}
