"""RouterState: what a router keeps in the state store, and how it keeps a view of it.

Keys (under the store's namespace):
  models/NAME         {"weights", "baseline", "rolled_back": {version: why}, "file_intent", "source", "by", "at"}
  replicas/NODE/NAME  the replicas router NODE fronts (under its lease: gone when the router dies)
  stats/NODE          {model: {version: {"requests", "errors", "window", "window_errors", "ttft", "tpot"}}}
                      each router's canary figures, its window's latency sketches as text (leased)
  members/NODE, leader   the Session's (a member's value names its host: the workloads' liveness)
  workloads/ID        a workload's record (workloads.py), written through ``put``
  batches/ID          an online batch object (router/batch/store.py); ``leader_hooks`` tell its runner
Nothing here runs on a request's path: changes are queued to one writer task (a request that rolls
a canary back only appends to a queue), and reads come from ``self.view``, which one watch keeps current.

File vs store: each model's stored record carries a hash of the deployment file's entry it came
from. At start and on reload, an unchanged entry means the stored weights and rollbacks win (they
were set at run time, after the file); a changed entry is a new intent and the file wins. Both are logged.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import time

from polychip.router.guard import JUDGED, Published
from polychip.router.state import Event, Session, StateStore, StoreError, open_store

log = logging.getLogger("polychip.router.state")
STATS_EVERY = 1.0          # seconds between a router's publications of its canary figures
DELETE = object()


def file_intent(weights: dict, baseline: str) -> str:
    text = json.dumps({"weights": weights, "baseline": baseline}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RouterState:
    def __init__(self, cfg, rollout, dispatcher):
        self.cfg, self.rollout, self.dispatcher = cfg, rollout, dispatcher
        self.node_id = cfg.node_id or f"{socket.gethostname()}-{cfg.port}"
        self.host = cfg.node_id or socket.gethostname()   # the host its workloads are placed on
        self.store: StateStore | None = None
        self.session: Session | None = None
        self.view: dict[str, object] = {}            # key -> value, every key, kept by the watch
        self.writes = self.write_errors = 0
        self.write_seconds = 0.0
        self._pending: dict[str, tuple[object, bool]] = {}    # key -> (value, leased): latest wins
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._published: dict = {}
        self._unreadable: set = set()                 # (stats key, model, version) already logged
        self._registry: dict[str, object] = {}       # what this router last wrote of its replicas
        self.last_adopted: dict | None = None         # the last change another router made: how late it came
        self.leader_hooks: list = []                  # called on the event loop when the leader changes

    @property
    def leader(self) -> str | None:
        return self.session.leader if self.session else None

    @property
    def is_leader(self) -> bool:
        return self.session is not None and self.session.is_leader

    # lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        cfg = self.cfg
        self.store = await asyncio.to_thread(open_store, cfg.state, cfg.state_dir, cfg.port)
        self.session = Session(self.store, self.node_id, cfg.state_lease_ttl, {"started": time.time(), "host": self.host},
                               on_leader=self._leader_changed)
        entries, rev = await asyncio.to_thread(self.store.list, "")
        self.view = {e.key: e.value for e in entries}
        self._watch = await asyncio.to_thread(self.store.watch, "", self._on_event, rev + 1)   # etcd reads its keys
        await asyncio.to_thread(self.session.start)
        self.rollout.may_decide = lambda: self.is_leader
        self.rollout.on_change = self.route_changed
        log.info("state: %s, node %s, %d stored models, leader %s", self.store.backend, self.node_id,
                 len(self.models_view()), self.leader)
        self._tasks = [asyncio.ensure_future(self._writer()), asyncio.ensure_future(self._publish_stats())]

    def _leader_changed(self, who: str | None) -> None:
        """On a store thread (or start's): log it, and run the hooks (batch jobs) on the event loop."""
        log.warning("state: leader is %s", who)
        for hook in self.leader_hooks:
            self._loop.call_soon_threadsafe(hook)

    async def stop(self) -> None:
        await self.flush()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if getattr(self, "_watch", None) is not None:
            self._watch.cancel()
        if self.session is not None and self.session.lease is not None:
            await asyncio.to_thread(self.session.close)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    async def flush(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline and self._tasks:
            await asyncio.sleep(0.02)

    # the view
    def _on_event(self, ev: Event) -> None:
        """On the store's thread: hand the change to the event loop."""
        self._loop.call_soon_threadsafe(self._apply_event, ev)

    def _apply_event(self, ev: Event) -> None:
        if ev.kind == "delete":
            self.view.pop(ev.key, None)
            return
        self.view[ev.key] = ev.value
        if ev.key.startswith("models/") and isinstance(ev.value, dict) and ev.value.get("by") != self.node_id:
            self._adopt(ev.key[len("models/"):], ev.value, "another router")

    def models_view(self) -> dict[str, dict]:
        return {k[len("models/"):]: v for k, v in self.view.items() if k.startswith("models/")}

    def _adopt(self, name: str, stored: dict, why: str) -> None:
        route = self.rollout.models.get(name)
        if route is None:
            return                            # applied when the model appears (learn or declare)
        weights = {v: float(w) for v, w in stored["weights"].items()}
        if route.weights == weights and route.rolled_back == stored.get("rolled_back", {}):
            return
        route.weights = {**route.weights, **weights}
        route.rolled_back = dict(stored.get("rolled_back", {}))
        route._current.clear()
        if why == "another router" and stored.get("at"):
            self.last_adopted = {"model": name, "by": stored.get("by"), "lag_s": round(time.time() - stored["at"], 4)}
        log.info("state: %s weights now %s (from %s: %s by %s)", name, route.weights, why,
                 stored.get("source"), stored.get("by"))
        self.dispatcher.pump()

    def adopt_learnt(self, name: str) -> None:
        """A model learnt from a replica: weights stored for it (set at run time) apply."""
        stored = self.models_view().get(name)
        if stored is not None:
            self._adopt(name, stored, "the store")

    def reconcile(self, declared: list) -> None:
        """After the deployment file is applied (start or reload): say per model whether the file
        or the stored state wins, and make the rollout and the store agree."""
        stored_models = self.models_view()
        for m in declared:
            route = self.rollout.models[m.name]
            intent = file_intent(dict(m.versions), m.baseline_version)
            stored = stored_models.get(m.name)
            if stored is None:
                self.route_changed(route, "file", intent)
            elif stored.get("file_intent") != intent:
                log.warning("state: model %s: the deployment file changed (a new intent), its weights %s win over "
                            "the stored %s (%s by %s)", m.name, route.weights, stored["weights"],
                            stored.get("source"), stored.get("by"))
                self.route_changed(route, "file", intent)
            elif stored["weights"] != route.weights or stored.get("rolled_back", {}) != route.rolled_back:
                log.warning("state: model %s: the stored weights %s and rollbacks %s (%s by %s) win over the "
                            "deployment file's %s, unchanged since they were set", m.name, stored["weights"],
                            stored.get("rolled_back", {}), stored.get("source"), stored.get("by"), route.weights)
                self._adopt(m.name, stored, "the store")

    # writes (queued; the writer task does them in order, the latest value of a key wins)
    def route_changed(self, route, source: str, intent: str | None = None) -> None:
        old = self.models_view().get(route.name) or {}
        value = {"weights": dict(route.weights), "baseline": route.baseline, "rolled_back": dict(route.rolled_back),
                 "file_intent": intent or old.get("file_intent"), "source": source, "by": self.node_id,
                 "at": time.time()}
        self.view["models/" + route.name] = value
        self._queue("models/" + route.name, value, leased=False)

    def replica_changed(self, replica, gone: bool = False) -> None:
        """Called on every health check: writes only when what the others see would change."""
        key = f"replicas/{self.node_id}/{replica.name}"
        value = DELETE if gone else {"url": replica.url, "model": replica.serving_model, "launched": replica.launched,
                                     "version": replica.serving_version, "up": replica.up}
        if self._registry.get(key) != value:
            self._registry[key] = value
            self._queue(key, value, leased=True)

    def put(self, key: str, value) -> None:
        """Store ``value`` (not leased) from the writer task; the view has it at once."""
        self.view[key] = value
        self._queue(key, value, leased=False)

    def routers_of(self, host: str) -> list[str]:
        """The live routers (node ids) other than this one that place workloads on ``host``."""
        return sorted(k[len("members/"):] for k, v in self.view.items() if k.startswith("members/")
                      and isinstance(v, dict) and v.get("host") == host and k != "members/" + self.node_id)

    def live_hosts(self) -> set[str]:
        """The hosts that have a live router (its member key, under its lease), this one included."""
        return {self.host} | {v.get("host") for k, v in self.view.items()
                              if k.startswith("members/") and isinstance(v, dict)}

    def _queue(self, key: str, value, leased: bool) -> None:
        self._pending[key] = (value, leased)
        self._wake.set()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:      # weights and rollbacks first: the registry and figures can wait
                key = next((k for k in self._pending if k.startswith("models/")), next(iter(self._pending)))
                value, leased = self._pending.pop(key)
                t0 = time.perf_counter()
                try:
                    await asyncio.to_thread(self._write, key, value, leased)
                    self.writes += 1
                except StoreError as e:
                    self.write_errors += 1
                    self._pending.setdefault(key, (value, leased))     # a newer value, if any, wins
                    log.warning("state: writing %s failed, retrying in 1 s: %s", key, e)
                    await asyncio.sleep(1.0)
                self.write_seconds += time.perf_counter() - t0

    def _write(self, key: str, value, leased: bool) -> None:
        if value is DELETE:
            self.session.delete_leased(key) if leased else self.store.delete(key)
        elif leased:
            self.session.put_leased(key, value)
        else:
            self.store.put(key, value)

    # canary figures: each router publishes its own; the leader's guard judges them merged
    def local_stats(self) -> dict:
        """{model: {version: {"requests", "errors" (since start), "window", "window_errors", and
        the window's "ttft" and "tpot" sketches}}}."""
        out: dict = {}
        for (model, version), s in self.rollout.stats.items():
            out.setdefault(model, {})[version] = s.published()
        return out

    async def _publish_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_EVERY)
            self.guard_tick()

    def guard_tick(self) -> None:
        """Once a second: publish this router's figures, take the others' into the rollout, and on
        the leader judge every canary on the merged counts."""
        stats = self.local_stats()
        if stats != self._published:
            self._published = stats
            self._queue(f"stats/{self.node_id}", stats, leased=True)
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

    async def describe(self) -> dict:
        try:
            backend = await asyncio.to_thread(self.store.describe)
        except StoreError as e:
            backend = {"backend": self.store.backend, "error": str(e)}
        registry: dict = {}
        for key, value in self.view.items():
            if key.startswith("replicas/"):
                node, _, name = key[len("replicas/"):].partition("/")
                registry.setdefault(node, {})[name] = value
        return {"store": backend, "node_id": self.node_id, "leader": self.leader,
                "leader_since": self.session.leader_since if self.session else None,
                "members": sorted(k[len("members/"):] for k in self.view if k.startswith("members/")),
                "models": self.models_view(), "registry": registry, "stats": self.merged_stats(),
                "last_adopted": self.last_adopted, "writes": self.writes, "write_errors": self.write_errors, "pending_writes": len(self._pending),
                "write_seconds": round(self.write_seconds, 4)}
