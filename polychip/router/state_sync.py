"""RouterState: what a router keeps in the state store, and how it keeps a view of it.

Keys (under the store's namespace):
  models/NAME         {"weights", "baseline", "rolled_back": {version: why}, "file_intent", "source", "by", "at"}
  replicas/NODE/NAME  the replicas router NODE fronts (under its lease: gone when the router dies)
  stats/NODE          {model: {version: {"requests", "errors", "window", "window_errors", "ttft", "tpot"}}}
                      each router's canary figures, its window's latency sketches as text (leased)
  members/NODE, leader   the Session's (a member's value names its host: the workloads' liveness)
  workloads/ID        a workload's record (workloads.py), written through ``put``
  batches/ID          an online batch object (router/batch/store.py); ``leader_hooks`` tell its runner
Nothing here runs on a request's path: changes are queued to one writer task (state/writer.py: a
request that rolls a canary back only appends to a queue), and reads come from ``self.view``, which
one watch keeps current; records are read through the typed repositories (state/repos.py), which skip
what they cannot read instead of failing. The guard's rollbacks are leader writes: they carry the
session's term, and the store drops them once another router leads.

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
from typing import Callable

from polychip.router.state_figures import STATS_EVERY, SharedFigures
from polychip.router.state import Event, Session, StateStore, StoreError, open_store
from polychip.router.state.loops import AsyncLoop
from polychip.router.state.records import MemberRecord, ModelRecord, ReplicaRecord
from polychip.router.state.repos import Repos
from polychip.router.state.writer import DELETE, StateWriter, Write

log = logging.getLogger("polychip.router.state")



def file_intent(weights: dict, baseline: str) -> str:
    text = json.dumps({"weights": weights, "baseline": baseline}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RouterState(SharedFigures):
    def __init__(self, cfg, rollout, dispatcher):
        self.cfg, self.rollout, self.dispatcher = cfg, rollout, dispatcher
        self.node_id = cfg.node_id or f"{socket.gethostname()}-{cfg.port}"
        self.host = cfg.node_id or socket.gethostname()   # the host its workloads are placed on
        self.store: StateStore | None = None
        self.session: Session | None = None
        self.view: dict[str, object] = {}            # key -> value, every key, kept by the watch
        self.repos = Repos()
        self.loop_failures: dict[str, int] = {}       # loop name -> failures reported
        self.on_loop_failure = None                   # a task supervisor's hook, when one is given
        self.writer = StateWriter(self._write, self._loop_failed)
        self.figures = AsyncLoop("canary figures", self.guard_tick, STATS_EVERY, self._loop_failed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._writing = False
        self._published: dict = {}
        self._unreadable: set = set()                 # (stats key, model, version) already logged
        self._registry: dict[str, object] = {}       # what this router last wrote of its replicas
        self.last_adopted: dict | None = None         # the last change another router made: how late it came
        self.leader_hooks: list = []                  # called on the event loop when the leader changes

    @property
    def _pending(self) -> dict[str, Write]:
        return self.writer.pending

    @property
    def leader(self) -> str | None:
        return self.session.leader if self.session else None

    @property
    def is_leader(self) -> bool:
        return self.session is not None and self.session.is_leader

    # lifecycle
    def open(self) -> StateStore:
        """Open the store (blocking; StoreError naming the store and the cause). The command calls it
        before it serves, so that a store that refuses this router is one line, not a failed start."""
        if self.store is None:
            cfg = self.cfg
            self.store = open_store(cfg.state, cfg.state_dir, cfg.port, cfg.etcd if cfg.etcd.given else None)
            self.store.on_loop_failure = self._loop_failed
        return self.store

    async def start(self, supervise: Callable[[object], None] | None = None) -> None:
        """Open the store and the session; the writer and the figures loops run under ``supervise`` (the
        router's task supervisor, which stops them last), or on tasks of their own when alone (tools, tests)."""
        self._loop = asyncio.get_running_loop()
        cfg = self.cfg
        if self.store is None:
            await asyncio.to_thread(self.open)
        member = MemberRecord(started=time.time(), host=self.host).stored()
        self.session = Session(self.store, self.node_id, cfg.state_lease_ttl, member,
                               on_leader=self._leader_changed, on_failure=self._loop_failed)
        entries, rev = await asyncio.to_thread(self.store.list, "")
        self.view = {e.key: e.value for e in entries}
        self._watch = await asyncio.to_thread(self.store.watch, "", self._on_event, rev + 1)   # etcd reads its keys
        await asyncio.to_thread(self.session.start)
        self.rollout.may_decide = lambda: self.is_leader
        self.rollout.on_change = self.route_changed
        log.info("state: %s, node %s, %d stored models, leader %s", self.store.backend, self.node_id,
                 len(self.models_view()), self.leader)
        self._writing = True
        if supervise is None:
            self._tasks = [self._run(self.writer), self._run(self.figures)]
        else:
            for loop in (self.writer, self.figures):
                supervise(loop)

    def loops(self) -> list:
        """Every background loop of the state layer (name, run(), stop(), status): the writer, the
        session's keep-alive and fence, the store's watch streams or delivery and lease expiry."""
        session = self.session.loops() if self.session is not None else []
        return [self.writer, self.figures, *session, *(self.store.loops() if self.store is not None else [])]

    def health(self) -> dict:
        """/health's view: each loop's state; ``ok`` False when one is dead or failing."""
        loops = [loop.status.snapshot() for loop in self.loops()]
        return {"ok": all(lp["state"] in ("running", "starting") for lp in loops), "leader": self.leader,
                "pending_writes": len(self.writer.pending), "loops": loops}

    def _loop_failed(self, name: str, e: BaseException) -> None:
        """Every state loop reports each failure here (each loop logs it with its cause)."""
        self.loop_failures[name] = self.loop_failures.get(name, 0) + 1
        if self.on_loop_failure is not None:
            self.on_loop_failure(name, e)

    def _run(self, loop) -> asyncio.Task:
        """Run an asyncio loop object; its end other than by stop() is reported, never silent."""
        task = asyncio.ensure_future(loop.run())

        def ended(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                loop.status.state = "dead"
                log.error("state loop %s died: %r", loop.name, t.exception())
                self._loop_failed(loop.name, t.exception())
        task.add_done_callback(ended)
        return task

    def _leader_changed(self, who: str | None) -> None:
        """On a store thread (or start's): log it, and run the hooks (batch jobs) on the event loop."""
        log.warning("state: leader is %s", who)
        for hook in self.leader_hooks:
            self._loop.call_soon_threadsafe(hook)

    async def stop(self) -> None:
        await self.flush()
        self.writer.stop()
        self.figures.stop()
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
        if self._writing and self.writer.status.state != "stopped":    # started, and not stopped yet
            await self.writer.flush(timeout)

    # the view
    def _on_event(self, ev: Event) -> None:
        """On the store's thread: hand the change to the event loop."""
        self._loop.call_soon_threadsafe(self._apply_event, ev)

    def _apply_event(self, ev: Event) -> None:
        if ev.kind == "delete":
            self.view.pop(ev.key, None)
            return
        self.view[ev.key] = ev.value
        if ev.key.startswith("models/"):
            stored = self.repos.models.decode(ev.key, ev.value)
            if stored is not None and stored.by != self.node_id:
                self._adopt(ev.key[len("models/"):], stored, "another router")

    def models_view(self) -> dict[str, ModelRecord]:
        return self.repos.models.all(self.view.items())

    def _adopt(self, name: str, stored: ModelRecord, why: str) -> None:
        route = self.rollout.models.get(name)
        if route is None:
            return                            # applied when the model appears (learn or declare)
        if route.weights == stored.weights and route.rolled_back == stored.rolled_back:
            return
        route.weights = {**route.weights, **stored.weights}
        route.rolled_back = dict(stored.rolled_back)
        route._current.clear()
        if why == "another router" and stored.at:
            self.last_adopted = {"model": name, "by": stored.by, "lag_s": round(time.time() - stored.at, 4)}
        log.info("state: %s weights now %s (from %s: %s by %s)", name, route.weights, why, stored.source, stored.by)
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
            elif stored.file_intent != intent:
                log.warning("state: model %s: the deployment file changed (a new intent), its weights %s win over "
                            "the stored %s (%s by %s)", m.name, route.weights, stored.weights, stored.source, stored.by)
                self.route_changed(route, "file", intent)
            elif stored.weights != route.weights or stored.rolled_back != route.rolled_back:
                log.warning("state: model %s: the stored weights %s and rollbacks %s (%s by %s) win over the "
                            "deployment file's %s, unchanged since they were set", m.name, stored.weights,
                            stored.rolled_back, stored.source, stored.by, route.weights)
                self._adopt(m.name, stored, "the store")

    # writes (queued; the writer task does them in order, the latest value of a key wins)
    def route_changed(self, route, source: str, intent: str | None = None) -> None:
        """The rollout changed a model's weights. The guard's change is the leader's: it carries the
        term, so if this router no longer leads when the write reaches the store, it is dropped."""
        key = self.repos.models.key(route.name)
        old = self.models_view().get(route.name)
        value = ModelRecord(weights=route.weights, baseline=route.baseline, rolled_back=route.rolled_back,
                            file_intent=intent or (old.file_intent if old else None), source=source,
                            by=self.node_id, at=time.time()).stored()
        self.view[key] = value
        self.writer.queue(key, value, term=self.session.term if source == "guard" and self.session else None)

    def replica_changed(self, replica, gone: bool = False) -> None:
        """Called on every health check: writes only when what the others see would change."""
        key = self.repos.replicas.key(f"{self.node_id}/{replica.name}")
        value = DELETE if gone else ReplicaRecord(url=replica.url, model=replica.serving_model,
                                                  launched=replica.launched, version=replica.serving_version,
                                                  up=replica.up).stored()
        if self._registry.get(key) != value:
            self._registry[key] = value
            self.writer.queue(key, value, leased=True)

    def put(self, key: str, value) -> None:
        """Store ``value`` (not leased) from the writer task; the view has it at once."""
        self.view[key] = value
        self.writer.queue(key, value)

    def routers_of(self, host: str) -> list[str]:
        """The live routers (node ids) other than this one that place workloads on ``host``."""
        return sorted(node for node, m in self.repos.members.all(self.view.items()).items()
                      if m.host == host and node != self.node_id)

    def live_hosts(self) -> set[str]:
        """The hosts that have a live router (its member key, under its lease), this one included."""
        return {self.host} | {m.host for m in self.repos.members.all(self.view.items()).values()}

    def _write(self, key: str, w: Write) -> None:
        """The writer's one write, in its thread."""
        if w.value is DELETE:
            self.session.delete_leased(key) if w.leased else self.store.delete(key, term=w.term)
        elif w.leased:
            self.session.put_leased(key, w.value)
        else:
            self.store.put(key, w.value, term=w.term)

    async def describe(self) -> dict:
        try:
            backend = await asyncio.to_thread(self.store.describe)
        except StoreError as e:
            backend = {"backend": self.store.backend, "error": str(e)}
        registry: dict = {}
        for path, record in self.repos.replicas.all(self.view.items()).items():
            node, _, name = path.partition("/")
            registry.setdefault(node, {})[name] = record.model_dump(exclude={"schema_version"})
        w = self.writer
        return {"store": backend, "node_id": self.node_id, "leader": self.leader,
                "term": self.session.term if self.session else None,
                "leader_since": self.session.leader_since if self.session else None,
                "members": sorted(k[len("members/"):] for k in self.view if k.startswith("members/")),
                "models": {n: r.model_dump(exclude={"schema_version"}) for n, r in self.models_view().items()},
                "registry": registry, "stats": self.merged_stats(), "last_adopted": self.last_adopted,
                "writes": w.writes, "write_errors": w.status.failures, "pending_writes": len(w.pending),
                "write_seconds": round(w.seconds, 4), "writer": w.figures(), "loops": self.health()["loops"],
                "unreadable": self.repos.unreadable.describe()}
