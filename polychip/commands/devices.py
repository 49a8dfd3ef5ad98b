"""polychip devices [--json] [--device-config FILE] [--plugin P]: every plugin and its devices,
then the version matrix (plugin and API version, driver, runtime, collective library, firmware).

A plugin that failed to import, declared another API version or is not available is shown
with the step that failed and why; it is never dropped. Exit status 1 when something asked for
failed: the spec of --device-config, a device's init, or a plugin named by --plugin or
POLYCHIP_PLUGINS; a built-in or installed plugin that is merely unavailable here is not a failure.
"""
from __future__ import annotations

import json
import sys

from polychip.devices import boundary
from polychip.devices.discovery import PluginRecord, discover_plugins, init_plugin
from polychip.devices.plugin import VERSION_KEYS
from polychip.devices.spec import DeviceSpec, check_against_devices, fmt_bytes, load_spec
from polychip.errors import DeviceSpecError, PolychipError
from polychip.flags import Parser


def _device_row(cls, spec: DeviceSpec | None, index: int) -> dict:
    """Open one device to report it: Ready with its figures, or Error with the reason."""
    row = {"index": index, "status": "Ready", "reason": ""}
    plugin = cls()
    try:
        init_plugin(plugin, spec, index)
        info = next(i for i in boundary.devices(plugin) if i.index == index)
        free, total = boundary.mem_info(plugin)
        row.update(name=info.name, total_memory=total, free_memory=free, dtypes=list(info.dtypes),
                   compute=info.compute, topology=info.topology, versions=boundary.versions(plugin),
                   health=boundary.health_dict(boundary.health(plugin) or info.health))
    except Exception as e:  # the point is to show it, whatever it is
        row.update(status="Error", reason=str(e) if isinstance(e, PolychipError) else f"{type(e).__name__}: {e}")
    finally:
        try:
            plugin.destroy()
        except Exception:  # already reported above if it matters
            pass
    return row


def describe(rec: PluginRecord, spec: DeviceSpec | None) -> dict:
    p = rec.plugin
    out = {"name": rec.name, "source": rec.source, "status": "Ready" if rec.ok else "Error", "priority": rec.priority,
           "failed_step": rec.failed_step, "reason": rec.reason,
           "plugin_version": getattr(p, "plugin_version", None), "api_version": getattr(p, "api_version", None),
           "torch_device_type": getattr(p, "torch_device_type", None), "devices": []}
    if not rec.ok:
        return out
    spec = spec if spec is not None and spec.device_type == rec.name else None
    try:
        infos = boundary.devices(p, spec, for_spec=True)
        if spec is not None:
            out["spec"] = spec.source
            check_against_devices(spec, rec.name, infos)
        ids = spec.device_ids if spec is not None else [i.index for i in infos]
    except Exception as e:
        out.update(status="Error", failed_step="discover" if spec is None else "spec",
                   reason=str(e) if isinstance(e, PolychipError) else f"{type(e).__name__}: {e}")
        return out
    out["devices"] = [_device_row(type(p), spec, i) for i in ids]
    return out


def _text(entry: dict) -> list[str]:
    head = f"{entry['name']} {entry['plugin_version'] or '?'}  ({entry['source']})"
    if entry["status"] != "Ready":
        return [f"{head}  Error at {entry['failed_step']}: {entry['reason']}"]
    lines = [head + (f"  spec {entry['spec']}" if entry.get("spec") else "")]
    for d in entry["devices"]:
        if d["status"] != "Ready":
            lines.append(f"  [{d['index']}] Error: {d['reason']}")
            continue
        compute = " ".join(f"{k}={v:g}" for k, v in d["compute"].items())
        topo = " ".join(f"{k}={v}" for k, v in d["topology"].items())
        lines.append(f"  [{d['index']}] {d['name']}  Ready  memory {fmt_bytes(d['free_memory'])} free / "
                     f"{fmt_bytes(d['total_memory'])}  dtypes {','.join(d['dtypes'])}")
        lines.append(f"      compute {compute or '-'}  topology {topo or '-'}")
        if d.get("health"):
            lines.append("      health " + " ".join(f"{k}={v}" for k, v in d["health"].items()))
    return lines


def version_matrix(entries: list[dict]) -> list[str]:
    """One row per ready device: plugin and API version, then each ``versions()`` entry."""
    rows = [(f"{e['name']}:{d['index']}", e["plugin_version"] or "?", str(e["api_version"]), d["versions"])
            for e in entries if e["status"] == "Ready" for d in e["devices"] if d["status"] == "Ready"]
    if not rows:
        return []
    extra = sorted({k for *_, v in rows for k in v} - set(VERSION_KEYS))
    cols = ["device", "plugin", "api", *VERSION_KEYS, *extra]
    cells = [[dev, pv, api, *(v.get(k, "-") for k in (*VERSION_KEYS, *extra))] for dev, pv, api, v in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return ["", "Version matrix:", fmt(cols)] + [fmt(r) for r in cells]


def rank_rows(args) -> list[dict]:
    """Each tensor-parallel rank of this node with the device it would open, and that device's memory."""
    from polychip.config import EngineConfig
    from polychip.devices.discovery import open_device
    from polychip.distributed.world import World, local_devices
    config = EngineConfig(device=args.device, plugins=tuple(args.plugins), device_config=args.device_config,
                          tp_size=args.tp_size, nnodes=args.nnodes, node_rank=args.node_rank,
                          dist_init_addr="127.0.0.1:1" if args.nnodes > 1 else None)
    world = World.from_config(config)
    rows = []
    for rank, device in zip(world.local_ranks, local_devices(config, world)):
        plugin = open_device(device, tuple(args.plugins), args.device_config)
        try:
            free, total = boundary.mem_info(plugin)
        finally:
            plugin.destroy()
        rows.append({"rank": rank, "node": world.node_rank, "device": device, "backend": plugin.communicator_backend(),
                     "free_memory": free, "total_memory": total})
    return rows


def main(argv: list[str]) -> int:
    p = Parser(prog="polychip devices", description=__doc__)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--device-config", default=None, help="device spec YAML applied to the plugin it names")
    p.add_argument("--plugin", action="append", default=[], dest="plugins",
                   help="extra device plugin: module.path or path/to/plugin.py (repeatable)")
    g = p.add_argument_group("tensor parallelism: also show the device and memory of each rank on this node")
    g.add_argument("--tp-size", type=int, default=None)
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--node-rank", type=int, default=0)
    g.add_argument("--device", default="auto", help="the plugin the ranks use (as for serve)")
    args = p.parse_args(argv)
    from polychip.commands.common import fail
    try:
        spec = load_spec(args.device_config) if args.device_config else None
        ranks = rank_rows(args) if args.tp_size else None
    except PolychipError as e:
        return fail(e)
    records = discover_plugins(tuple(args.plugins))
    entries = [describe(rec, spec) for rec in records]
    if spec is not None and not any(e["name"] == spec.device_type for e in entries):
        return fail(DeviceSpecError(f"{spec.source}: device_type: no plugin named {spec.device_type!r}; "
                                    f"found {[e['name'] for e in entries]}"))
    if args.json:
        print(json.dumps(entries if ranks is None else {"plugins": entries, "ranks": ranks}, indent=2))
    else:
        for e in entries:
            print("\n".join(_text(e)))
        print("\n".join(version_matrix(entries)))
        if ranks is not None:
            print(f"tensor parallel --tp-size {args.tp_size} over {args.nnodes} node(s); node {args.node_rank} runs:")
            for r in ranks:
                print(f"  rank {r['rank']}: {r['device']} ({r['backend']})  memory {fmt_bytes(r['free_memory'])} "
                      f"free / {fmt_bytes(r['total_memory'])}")
    problems = failures(records, entries, spec)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0


def failures(records: list[PluginRecord], entries: list[dict], spec: DeviceSpec | None) -> list[str]:
    """What was asked for and failed: explicit plugins, the spec's plugin and devices, device inits."""
    out = [f"{r.describe_failure()}" for r in records if r.explicit and not r.ok]
    explicit = {r.name for r in records if r.explicit and r.ok}
    for e in entries:
        if e["name"] in explicit and e["status"] != "Ready":     # loaded, then failed to report its devices
            out.append(f"plugin {e['name']!r} ({e['source']}) failed at {e['failed_step']}: {e['reason']}")
        named = spec is not None and e["name"] == spec.device_type
        if named and e["status"] != "Ready":
            out.append(f"{spec.source}: plugin {e['name']!r} failed at {e['failed_step']}: {e['reason']}")
        out += [f"{e['name']}:{d['index']}: {d['reason']}" for d in e["devices"] if d["status"] != "Ready"]
    return list(dict.fromkeys(out))
