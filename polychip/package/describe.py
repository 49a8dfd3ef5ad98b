"""``polychip inspect``: a package's devices, quantisation, minimum memory, plan summary, version
matrix and files, read from its manifest and plan.json (both hash-checked; the weights are not read)."""
from __future__ import annotations

import json
import os

from polychip.devices.plugin import VERSION_KEYS
from polychip.devices.spec import fmt_bytes
from polychip.package.manifest import PLAN, PackageError
from polychip.package.op_plan import op_plan_summary
from polychip.package.reader import scan


def describe(path: str) -> dict:
    res = scan(path, until=PLAN)
    if res.plan_raw is None:
        raise PackageError(f"{path}: no {PLAN} among the members before the weights")
    try:
        plan = json.loads(res.plan_raw)
    except json.JSONDecodeError as e:
        raise PackageError(f"{path}: {PLAN}: not valid JSON ({e})") from None
    return {"path": path, "size": os.path.getsize(path), "manifest_sha256": res.manifest_sha256,
            "signature_key_id": res.signature_key_id, "manifest": res.manifest, "plan": plan}


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def describe_text(d: dict) -> str:
    m, plan = d["manifest"], d["plan"]
    model, target, versions = m.get("model", {}), m["target"], m["versions"]
    kid = d["signature_key_id"]
    mem = plan.get("memory", {})
    lines = [f"package    {d['path']} ({fmt_bytes(d['size'])}), format {m['format_version']}, created "
             f"{m.get('created', '?')}",
             f"manifest   sha256 {d['manifest_sha256']}",
             f"signature  " + (f"ed25519, key {kid[:16]} (verify it with polychip verify --trusted-key)" if kid
                               else "none (unsigned)"),
             f"model      {model.get('architecture')} from {model.get('source')}",
             f"devices    {', '.join(target['device_types'])} ({target.get('device_name') or '?'}"
             f"{', spec ' + target['spec'] if target.get('spec') else ''})",
             f"quantize   {model.get('quantization') or 'none'} ("
             + (f"{model['quantization_format']} checkpoint, "
                if model.get("quantization_format") not in (None, "polychip") else "")
             + f"compute dtype {model.get('dtype')})",
             f"memory     weights {mem.get('weights', '?')} minimum ({mem.get('weights_bytes')} bytes)",
             "plan"]
    lines += ["  " + s for s in op_plan_summary(plan)]
    ops = [["op", "version", "dtype", "implementation", "reason"]] + \
        [[str(r["op"]), str(r["version"]), str(r["dtype"]), str(r["implementation"]), str(r["reason"])]
         for r in plan.get("ops", [])]
    lines += _table(ops, "    ")
    dev = versions.get("device", {})
    keys = [*VERSION_KEYS, *sorted(set(dev) - set(VERSION_KEYS))]
    lines.append("versions   (built with)")
    lines += _table([["polychip", str(versions.get("polychip"))], ["torch", str(versions.get("torch"))],
                     ["plugin", str(versions.get("plugin"))], ["plugin API", str(versions.get("plugin_api"))]] +
                    [[k, dev.get(k, "-")] for k in keys])
    lines.append(f"files      {len(m['files'])}, {fmt_bytes(sum(f['size'] for f in m['files']))}")
    lines += _table([[f["name"], fmt_bytes(f["size"]), f["sha256"][:16]] for f in m["files"]])
    return "\n".join(lines)
