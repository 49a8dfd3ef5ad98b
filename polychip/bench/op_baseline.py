"""Op baselines: what ``polychip bench ops --save`` writes and ``--baseline`` compares against.

A baseline holds the device, the model and the run's settings, the version matrix (polychip, torch,
the plugin and what its ``versions()`` reports: driver, runtime, collective library, firmware) and
every measure's rounds. A comparison flags an op or step whose median is slower than the baseline's
by more than the threshold, or than three times the baseline's own spread where that is larger (a
noisy figure needs a larger change to count), and whose best round is slower by as much too (a burst
of load on the host slows some rounds; a slower kernel slows every round, the best one included). It
names the version keys that differ between the runs.

Where baselines live on a host: ``$POLYCHIP_BASELINE_DIR``, else ``baselines/`` under the cache
(``$POLYCHIP_CACHE`` or ``~/.cache/polychip``). ``--save`` with no file writes there, named by device,
model and version matrix; ``--baseline`` with no file reads the newest there for the same device and
model; ``polychip doctor`` lists them.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from polychip.errors import ConfigError

FORMAT, FORMAT_VERSION = "polychip-op-baseline", 1
DEFAULT_THRESHOLD = 0.15
SPREAD_FACTOR = 3.0          # a change must exceed this many times the baseline's relative spread
BASELINE_DIR_ENV = "POLYCHIP_BASELINE_DIR"


def baseline_dir() -> Path:
    env = os.environ.get(BASELINE_DIR_ENV)
    if env:
        return Path(env)
    cache = os.environ.get("POLYCHIP_CACHE") or os.path.expanduser("~/.cache/polychip")
    return Path(cache) / "baselines"


def flat_versions(versions: dict) -> dict[str, str]:
    """The version matrix as one level: ``driver``, ``runtime``, ... and ``polychip``, ``torch``, ``plugin``."""
    out = {k: str(v) for k, v in versions.items() if k != "device"}
    out.update({k: str(v) for k, v in (versions.get("device") or {}).items()})
    return out


def matrix_id(versions: dict) -> str:
    return hashlib.sha256(json.dumps(flat_versions(versions), sort_keys=True).encode()).hexdigest()[:10]


def default_path(result: dict) -> Path:
    model = Path(result["model"]["path"] or "embedded").name.replace(os.sep, "_") or "model"
    name = f"{result['device'].replace(':', '-')}-{model}-{matrix_id(result['versions'])}.json"
    return baseline_dir() / name


def save(result: dict, path: str | None) -> Path:
    out = Path(path) if path else default_path(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return out


def load(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"baseline {path}: no such file (write one with polychip bench ops --save)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"baseline {path}: cannot read it as JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"baseline {path}: not a polychip op baseline (format {FORMAT!r} version {FORMAT_VERSION})")
    return data


def stored() -> list[tuple[Path, dict]]:
    """Every readable baseline of this host, newest first."""
    found = []
    for f in sorted(baseline_dir().glob("*.json")):
        try:
            found.append((f, load(str(f))))
        except ConfigError:
            continue
    return sorted(found, key=lambda pair: pair[1].get("created", ""), reverse=True)


def newest_for(device: str, model_path: str | None) -> Path:
    for f, data in stored():
        if data.get("device") == device and data.get("model", {}).get("path") == model_path:
            return f
    raise ConfigError(f"no baseline for {device} and model {model_path or 'embedded'} in {baseline_dir()} "
                      f"(save one with polychip bench ops --save before the upgrade)")


def result(plugin, model: dict, settings: dict, versions: dict, measures: list) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": socket.gethostname(), "device": f"{plugin.name}:{plugin.index}",
            "spec": getattr(plugin.spec, "source", None), "model": model, "settings": settings,
            "versions": versions, "measures": [m.to_json() for m in measures]}


@dataclass
class Change:
    kind: str
    op: str
    phase: str
    base_s: float            # medians of the rounds
    new_s: float
    allowed: float           # the largest ratio - 1 that is not a regression
    best_ratio: float = 0.0  # the best round of the new run over the baseline's best round

    @property
    def ratio(self) -> float:
        return self.new_s / self.base_s if self.base_s > 0 else float("inf")

    @property
    def regressed(self) -> bool:
        return self.ratio > 1 + self.allowed and self.best_ratio > 1 + self.allowed

    @property
    def label(self) -> str:
        return f"{self.phase} step" if self.kind == "step" else f"{self.op} @ {self.phase}"


def comparable(base: dict, new: dict) -> None:
    """Refuse to compare runs of another device, model or settings: their figures mean other things."""
    for key in ("device", "settings"):
        if base.get(key) != new.get(key):
            raise ConfigError(f"the baseline was measured with {key} {base.get(key)!r}, this run with "
                              f"{new.get(key)!r}; compare like with like")
    if base["model"].get("path") != new["model"].get("path"):
        raise ConfigError(f"the baseline was measured on model {base['model'].get('path')!r}, this run on "
                          f"{new['model'].get('path')!r}")


def compare(base: dict, new: dict, threshold: float = DEFAULT_THRESHOLD) -> tuple[list[Change], dict, list[str]]:
    """(changes, version keys that differ {key: (was, now)}, measures present in only one run)."""
    comparable(base, new)
    old = {(m["kind"], m["op"], m["phase"]): m for m in base["measures"]}
    now = {(m["kind"], m["op"], m["phase"]): m for m in new["measures"]}
    changes = [Change(*key, old[key]["median_s"], now[key]["median_s"],
                      max(threshold, SPREAD_FACTOR * old[key].get("spread", 0.0)),
                      _ratio(now[key].get("best_s", now[key]["median_s"]), old[key].get("best_s", old[key]["median_s"])))
               for key in old if key in now]
    was, has = flat_versions(base["versions"]), flat_versions(new["versions"])
    versions = {k: (was.get(k), has.get(k)) for k in sorted(set(was) | set(has)) if was.get(k) != has.get(k)}
    lonely = [f"{k[1]} @ {k[2]}" for k in sorted(set(old) ^ set(now))]
    return changes, versions, lonely


def _ratio(new: float, old: float) -> float:
    return new / old if old > 0 else float("inf")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def report(changes: list[Change], versions: dict, lonely: list[str], threshold: float) -> list[str]:
    """The comparison as lines: every measure with its ratio, then the verdict naming what regressed."""
    width = max((len(c.label) for c in changes), default=10)
    lines = [f"{'measure'.ljust(width)}  {'baseline':>11}  {'now':>11}  ratio   best    allowed"]
    for c in sorted(changes, key=lambda c: (not c.regressed, c.kind, c.phase, c.op)):
        mark = "  REGRESSED" if c.regressed else ""
        lines.append(f"{c.label.ljust(width)}  {_ms(c.base_s):>11}  {_ms(c.new_s):>11}  {c.ratio:5.2f}x  "
                     f"{c.best_ratio:5.2f}x  +{c.allowed:.0%}{mark}")
    changed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in versions.items()) or "none"
    bad = [c for c in changes if c.regressed]
    lines += ["", f"version keys that changed: {changed}"]
    if lonely:
        lines.append(f"measured in only one of the runs (not compared): {', '.join(lonely)}")
    if bad:
        lines.append(f"REGRESSION: {len(bad)} of {len(changes)} measures slower than allowed (threshold "
                     f"{threshold:.0%}, or 3x the baseline's spread, in the median and the best round): " +
                     ", ".join(f"{c.label} {c.ratio:.2f}x" for c in bad) + f" (changed: {changed})")
    else:
        lines.append(f"ok: no measure slower than allowed (threshold {threshold:.0%}) in {len(changes)} compared")
    return lines
