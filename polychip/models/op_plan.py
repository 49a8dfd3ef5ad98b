"""The op plan a model folder may carry (``plan.json``, written by ``polychip pack``):
the loader applies its fusions and checks that the ops it resolves match the plan's.

Only reads JSON; building a plan is the package layer's job.
"""
from __future__ import annotations

import json
import os

from polychip.errors import ModelLoadError

PLAN_FILE = "plan.json"


def read_op_plan(model_dir: str) -> dict | None:
    """The folder's plan, or None when it has none."""
    path = os.path.join(model_dir, PLAN_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            plan = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not a valid plan ({type(e).__name__}: {e})") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("fusions"), list) or \
            not isinstance(plan.get("ops"), list):
        raise ModelLoadError(f"{path}: a plan needs 'fusions' and 'ops' lists")
    return plan


def planned_fusions(plan: dict, plugin_fusions: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
    """(the plan's fusions, warnings when the device now declares other ones)."""
    planned = tuple(plan["fusions"])
    warnings = []
    if set(planned) != set(plugin_fusions):
        warnings.append(f"the package's plan fuses {list(planned)}; this device's plugin declares "
                        f"{list(plugin_fusions)}; applying the plan's")
    return planned, warnings


def check_ops(plan: dict, resolutions: dict) -> list[str]:
    """One warning per planned op this device now resolves differently (or not at all).
    ``resolutions``: op name -> :class:`~polychip.ops.registry.Resolution` from the replace pass."""
    target = plan.get("target", {}).get("device_type", "?")
    warnings = []
    for row in plan["ops"]:
        res = resolutions.get(row.get("op"))
        built = f"{row.get('implementation')} ({row.get('dtype')}) on {target}"
        if res is None or res.version != row.get("version"):
            warnings.append(f"op {row.get('op')} v{row.get('version')}: the package was built with {built}; "
                            "this model no longer resolves it")
        elif res.source != row.get("implementation") or res.dtype != row.get("dtype"):
            why = f": {res.reason}" if res.reason else ""
            warnings.append(f"op {res.name} v{res.version}: the package was built with {built}; this device "
                            f"resolves {res.source} ({res.dtype}){why}")
    return warnings
