"""Per-stage engine time from a server's Prometheus ``/metrics`` (polychip's names, or any
server exposing ``*_stage_seconds*{stage="..."}``), as the difference over one benchmark step."""
from __future__ import annotations

import re

import httpx

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
STEPS_METRICS = ("polychip_engine_steps_total", "polychip_engine_steps")


def parse(text: str) -> dict:
    """{"stages": {stage: seconds}, "steps": count or None} from Prometheus exposition text."""
    stages: dict[str, float] = {}
    steps = None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))
        if "stage_seconds" in name and "stage" in labels and not name.endswith("_created"):
            stages[labels["stage"]] = stages.get(labels["stage"], 0.0) + value
        elif name in STEPS_METRICS:
            steps = (steps or 0) + value
    return {"stages": stages, "steps": steps}


async def scrape(client: httpx.AsyncClient, root: str) -> dict | None:
    """The parsed ``/metrics`` of the server at ``root``, or None when it exposes none."""
    try:
        r = await client.get(f"{root}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    parsed = parse(r.text)
    return parsed if parsed["stages"] else None


def delta(before: dict | None, after: dict | None) -> dict | None:
    """Stage seconds spent between two scrapes, with each stage's share and the step count."""
    if not before or not after:
        return None
    secs = {k: max(0.0, v - before["stages"].get(k, 0.0)) for k, v in after["stages"].items()}
    total = sum(secs.values())
    steps = None
    if after.get("steps") is not None and before.get("steps") is not None:
        steps = after["steps"] - before["steps"]
    return {"seconds": secs, "share": {k: (v / total if total else 0.0) for k, v in secs.items()},
            "steps": steps, "ms_per_step": {k: v * 1000 / steps for k, v in secs.items()} if steps else None}
