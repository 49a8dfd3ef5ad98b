"""The canary guard's figures among N routers: each router publishes its own window (``stats/NODE``,
leased), and the leader judges every canary on all of them summed (RouterState's part for the guard)."""
from __future__ import annotations

import logging

from polychip.router.rollout.guard import JUDGED, Published

log = logging.getLogger("polychip.router.state")
STATS_EVERY = 1.0          # seconds between a router's publications of its canary figures


class SharedFigures:
    """Needs ``rollout``, ``node_id``, ``view``, ``writer``, ``is_leader`` (RouterState has them)."""

    def local_stats(self) -> dict:
        """{model: {version: {"requests", "errors" (since start), "window", "window_errors", and
        the window's "ttft" and "tpot" sketches}}}."""
        out: dict = {}
        for (model, version), s in self.rollout.stats.items():
            out.setdefault(model, {})[version] = s.published()
        return out

    def guard_tick(self) -> None:
        """Once a second: publish this router's figures, take the others' into the rollout, and on
        the leader judge every canary on the merged counts."""
        stats = self.local_stats()
        if stats != self._published:
            self._published = stats
            self.writer.queue(f"stats/{self.node_id}", stats, leased=True)
        if self.is_leader:          # only the leader judges: only it reads the others' sketches
            self.rollout.others = self.others_windows()
            self.rollout.judge_all()
        else:
            self.rollout.others = {}

    def _published_by_others(self):
        """(stats key, {model: {version: figures}}) of every other live router."""
        mine = f"stats/{self.node_id}"
        for key, per_model in self.view.items():
            if key.startswith("stats/") and key != mine and isinstance(per_model, dict):
                yield key, per_model

    def others_windows(self) -> dict:
        """{(model, version): Published}: the other live routers' windows, counts and sketches summed
        (a router's figures that cannot be read are left out, and logged once)."""
        out: dict = {}
        for key, per_model in self._published_by_others():
            for model, versions in per_model.items():
                for version, f in versions.items():
                    try:
                        window = out.get((model, version)) or Published()
                        window.add(f["window"], f["window_errors"], f)
                        out[(model, version)] = window
                    except (KeyError, TypeError, ValueError) as e:
                        if (key, model, version) not in self._unreadable:
                            self._unreadable.add((key, model, version))
                            log.warning("state: %s: %s %s left out of the guard: %s", key, model, version, e)
        return out

    def merged_stats(self) -> dict:
        """{model: {version: {"requests", "errors", "window", "window_errors"}}} summed over every
        live router (the others' published figures, this router's own live ones)."""
        out: dict = {}
        for _, per_model in [*self._published_by_others(), (None, self.local_stats())]:
            for model, versions in per_model.items():
                for version, figures in versions.items():
                    acc = out.setdefault(model, {}).setdefault(version, {})
                    for name, n in figures.items():
                        if name not in JUDGED:
                            acc[name] = acc.get(name, 0) + n
        return out

