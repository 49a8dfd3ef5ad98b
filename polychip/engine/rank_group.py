"""A group of rank processes led by rank 0 (the engine's own process): what tensor parallelism and
pipeline parallelism share.

Rank 0 starts this node's other ranks as worker processes (engine/rank_workers.py), hosts the
rendezvous store and watches the group: a local worker's exit (polled every 0.25 s), a rank's
silent heartbeat, or a failed transfer ends in one fault, named after the rank (or stage) and its
device; callbacks registered with :meth:`RankGroup.on_fault` run once, so the server can turn
unhealthy and exit. Every non-zero rank reports its device and memory through its heartbeat.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from polychip.config import EngineConfig
from polychip.devices import boundary
from polychip.distributed.rendezvous import HeartbeatWatch, StoreServer, join, reported_failures
from polychip.distributed.world import LOCAL_HOST, rendezvous_address
from polychip.engine.rank_workers import POLL_PERIOD, LocalWorkers, world_secret
from polychip.errors import ConfigError, PolychipError

log = logging.getLogger("polychip.ranks")

STOP_TIMEOUT = 10.0         # seconds workers get to leave after the stop message


def model_signature(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                                         "num_layers", "num_heads", "num_kv_heads", "head_dim")}


def agree_on_pool(comm, pages: int, signature: dict, status: dict) -> tuple[int, list[dict]]:
    """Every rank's KV page count, model and device, gathered on the control group (model loads may
    take unequal times, so not under --dist-timeout). The smallest rank sets the page count; a rank
    that loaded another model is an error naming it. Returns (pages, every rank's status)."""
    everyone = comm.all_gather_json({"pages": pages, "model": signature, "status": status})
    for r, info in enumerate(everyone):
        if info["model"] != everyone[0]["model"]:
            diff = {k: (everyone[0]["model"][k], v) for k, v in info["model"].items() if everyone[0]["model"][k] != v}
            raise ConfigError(f"rank {r} loaded a different model than rank 0: {diff}")
    return min(info["pages"] for info in everyone), [info["status"] for info in everyone]


def device_status(plugin, rank: int, node: int, kv_bytes: int = 0) -> dict:
    """One rank's device, memory and health figures (JSON-ready: workers send it in their heartbeat)."""
    free, total = boundary.mem_info(plugin)
    return {"rank": rank, "node": node, "plugin": plugin.name, "device": plugin.index, "free_memory": free,
            "total_memory": total, "kv_pool_bytes": kv_bytes, "pid": os.getpid(), "health": device_health(plugin)}


def device_health(plugin) -> dict | None:
    """The figures the plugin's ``health()`` reports (API 1.2), None when it reports none; a plugin
    whose health() fails or answers in the wrong shape shows that as ``{"error": why}``, and the
    memory figures beside it stay."""
    try:
        return boundary.health_dict(boundary.health(plugin))
    except PolychipError as e:
        return {"error": e.args[0]}


class RankGroup:
    """Rank 0's view of a group: faults, the watch over workers and heartbeats, every rank's status.

    A subclass starts the processes and its links, sets ``workers``, ``server``, ``watch`` and
    ``plugin``, calls :meth:`start_monitor`, and says how to tell the workers to stop (``say_stop``)
    and how to close its links (``close_links``)."""

    what = "group"                 # the words of its messages: "tensor-parallel", "pipeline"
    error: type[PolychipError] = PolychipError

    def __init__(self, config: EngineConfig, world):
        self.config, self.world = config, world
        self.fault: str | None = None
        self.serving = False            # set once every rank has agreed on the pool: steps may run
        self.kv_pool_bytes = 0
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._statuses: dict[int, dict] = {}
        self.workers = self.server = self.watch = self.plugin = None

    def start(self, devices: list[str], module: str, role: str, open_plugin: Callable[[str], object],
              connect: Callable[[object], None], publish: Callable[[object], None] = lambda store: None) -> None:
        """Host the rendezvous, ``publish`` into its store what every rank reads there, start this node's
        other ranks on ``devices[1:]`` (``python -m module``), open rank 0's device, join, ``connect``
        this rank's links, and watch the group. A failure stops what started and names a worker's own
        error when one was reported."""
        config, world = self.config, self.world
        secret = world_secret(config)
        host, port = rendezvous_address(config)
        try:
            self.server = StoreServer(host, port, config.dist_init_timeout)
            publish(self.server.store)
            self.workers = LocalWorkers(config, world.local_ranks[1:], devices[1:], host, self.server.port, secret,
                                        module, role)
            self.plugin = open_plugin(devices[0])
            join(self.server.store, 0, world.size, world.facts(config), config.dist_init_timeout, world.node_of,
                 secret)
            connect(self.server.store)
            self.watch = HeartbeatWatch(host if host not in ("0.0.0.0", "::") else LOCAL_HOST, self.server.port,
                                        list(range(1, world.size)), max_silence=min(config.dist_timeout, 10.0))
        except BaseException as e:
            why = self._worker_errors()
            self.stop()
            if why and not isinstance(e, PolychipError):
                raise self.error(f"{self.what} start failed: {why}") from None
            raise
        self.start_monitor()

    def start_monitor(self) -> None:
        self._monitor = threading.Thread(target=self._watch_loop, name="polychip-rank-monitor", daemon=True)
        self._monitor.start()

    def agreed(self, pages: int, kv_bytes_per_page: int, statuses: list[dict]) -> None:
        """Every rank agreed on ``pages`` KV pages: record their statuses; steps may run."""
        for st in statuses:
            st.setdefault("kv_pool_bytes", pages * kv_bytes_per_page)
        self._statuses = {st["rank"]: st for st in statuses}
        self.kv_pool_bytes = self._statuses[0]["kv_pool_bytes"]
        self.serving = True

    def failure(self, err: BaseException, where: str = "a collective failed on rank 0") -> PolychipError:
        """The error for a failed transfer: the monitor's diagnosis when it has one (a worker's exit
        is seen within a poll period, so wait that long for it), else the transfer's."""
        deadline = time.monotonic() + 2 * POLL_PERIOD
        while self.fault is None and time.monotonic() < deadline:
            time.sleep(POLL_PERIOD / 5)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        said = self._worker_errors()          # a rank on another host may have said why it left
        self._set_fault(f"{where}: {first}" + (f" ({said})" if said else ""))
        return self.error(f"{self.what} group failed: {self.fault}")

    # faults
    def on_fault(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` runs once when the group fails (at once if it already has)."""
        with self._lock:
            fault = self.fault
            if fault is None:
                self._callbacks.append(callback)
        if fault is not None:
            callback(fault)

    def _set_fault(self, reason: str) -> None:
        with self._lock:
            if self.fault is not None or self._stopping.is_set():
                return
            self.fault = reason
            callbacks, self._callbacks = self._callbacks, []
        log.error("%s fault: %s", self.what, reason)
        for cb in callbacks:
            try:
                cb(reason)
            except Exception:
                log.exception("fault callback failed")

    def _worker_errors(self) -> str:
        """What workers said before they died (each writes its error into the store)."""
        if self.server is None or self.server.store is None:
            return ""
        try:
            return "; ".join(f"{self.name_rank(r)}: {m}"
                             for r, m in reported_failures(self.server.store, self.world.size).items())
        except RuntimeError:
            return ""

    def name_rank(self, rank: int) -> str:
        """How messages name a rank ("rank 1"; a pipeline says "stage 1 (simxpu:0)")."""
        return f"rank {rank}"

    def _watch_loop(self) -> None:
        while not self._stopping.wait(POLL_PERIOD):
            try:
                dead = self.workers.exited()
                if dead:
                    r, code = next(iter(dead.items()))
                    said = self._worker_errors()
                    self._set_fault(f"{self.workers.describe(r)} exited with code {code}" + (f" ({said})" if said else ""))
                    return
                silent = self.watch.silent()
                if silent:
                    nodes = sorted({self.world.node_of(r) for r in silent})
                    named = ", ".join(self.name_rank(r) for r in silent) if self.what != "tensor-parallel" \
                        else f"rank(s) {silent}"
                    self._set_fault(f"{named} on node(s) {nodes} sent no heartbeat for "
                                    f"{self.watch.max_silence:g}s (process dead or host unreachable)")
                    return
                for r in range(1, self.world.size):
                    st = self.watch.status(r)
                    if st is not None:
                        st["kv_pool_bytes"] = self._statuses.get(r, {}).get("kv_pool_bytes", 0)
                        self._statuses[r] = st
            except Exception as e:  # the store lives in this process; failing here is a bug, say it
                if not self._stopping.is_set():
                    self._set_fault(f"the {self.what} monitor failed: {type(e).__name__}: {e}")
                return

    def own_status(self) -> dict:
        return device_status(self.plugin, 0, 0, self.kv_pool_bytes)

    def statuses(self) -> list[dict]:
        """Every rank's device and memory: rank 0 read now, the others from their last heartbeat."""
        others = dict(self._statuses)          # the monitor thread replaces entries as beats come
        return [self.own_status()] + [others[r] for r in sorted(others) if r != 0]

    # stopping
    def say_stop(self) -> None:
        """Tell the healthy workers to leave (raise RuntimeError when the message cannot go)."""

    def close_links(self) -> None:
        """Close what connects this rank to the others."""

    def stop(self) -> None:
        """Tell the workers to leave (when the group is healthy), wait, then end what is left."""
        clean = self.fault is None and self.serving   # the workers wait for a step: say stop
        self._stopping.set()
        if clean:
            try:
                self.say_stop()
            except RuntimeError as e:
                log.warning("stop message not delivered: %s", e)
                clean = False
        if self.workers is not None:
            if not (clean and self.workers.wait(STOP_TIMEOUT)):
                self.workers.kill()
        self.close_links()
        if self.server is not None:
            self.server.close()
        if self.plugin is not None:
            self.plugin.destroy()
            self.plugin = None


