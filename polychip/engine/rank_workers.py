"""The processes of a rank group: how rank 0 (or node k's ``run_node``) starts a node's worker ranks,
and the entry point every worker process shares.

Every non-zero rank is a ``python -m <module>`` process (``polychip.engine.tp_worker`` for tensor
parallelism, ``polychip.engine.pipeline.worker`` for pipeline stages) that opens its own device. The
rendezvous secret reaches it in its environment, never on its command line.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from polychip.config import EngineConfig, parse_host_port
from polychip.distributed import secret as dist_secret
from polychip.distributed.rendezvous import DuplicateRankError, connect_store, report_failure
from polychip.distributed.world import World, local_devices, rendezvous_address
from polychip.errors import ConfigError, PolychipError
from polychip.flags import Parser

log = logging.getLogger("polychip.ranks")

POLL_PERIOD = 0.25          # seconds between checks of the local workers and the heartbeats


def worker_command(config: EngineConfig, rank: int, device: str, host: str, port: int,
                   module: str = "polychip.engine.tp_worker") -> list[str]:
    """A worker's command line (``python -m module``); the secret is not on it (see LocalWorkers)."""
    cfg = json.dumps(dataclasses.asdict(dataclasses.replace(config, dist_secret=None, dist_secret_file=None)))
    level = logging.getLevelName(logging.getLogger("polychip").getEffectiveLevel()).lower()
    return [sys.executable, "-m", module, "--rank", str(rank), "--device", device,
            "--store", f"[{host}]:{port}" if ":" in host else f"{host}:{port}", "--config", cfg,
            "--log-level", level if level in ("debug", "info", "warning", "error") else "warning"]


class LocalWorkers:
    """The worker processes this node started, one per local rank (``role`` names them in messages:
    "rank 1" under tensor parallelism, "stage 1" under pipeline parallelism)."""

    def __init__(self, config: EngineConfig, ranks: list[int], devices: list[str], host: str, port: int,
                 secret: bytes | None, module: str = "polychip.engine.tp_worker", role: str = "rank"):
        self.ranks, self.devices, self.role = ranks, devices, role
        self.procs: dict[int, subprocess.Popen] = {}
        env = dict(os.environ)                 # the secret reaches the workers in their environment only
        env.pop(dist_secret.ENV_VAR, None)
        if secret is not None:
            env[dist_secret.ENV_VAR] = secret.decode()
        try:
            for rank, device in zip(ranks, devices):
                self.procs[rank] = subprocess.Popen(worker_command(config, rank, device, host, port, module),
                                                    env=env)
        except OSError as e:
            self.kill()
            raise ConfigError(f"cannot start a worker process: {e}") from None

    def exited(self) -> dict[int, int]:
        """Ranks whose process has ended, with the exit code."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def describe(self, rank: int) -> str:
        p = self.procs[rank]
        return f"{self.role} {rank} ({self.devices[self.ranks.index(rank)]}, pid {p.pid})"

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL whatever is left after ``grace`` seconds."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        if not self.wait(grace):
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
            self.wait(5.0)


def world_secret(config: EngineConfig) -> bytes | None:
    """The rendezvous secret: the one given, else (one host) a random one for this node's ranks."""
    secret = dist_secret.resolve(config.dist_secret, config.dist_secret_file)
    if secret is None and config.nnodes == 1 and config.node_rank == 0:
        return dist_secret.random_secret()
    if secret is None:
        log.warning("%d nodes without --dist-secret(-file): any process that reaches %s can join as a rank",
                    config.nnodes, config.dist_init_addr)
    return secret


def worker_main(argv: list[str] | None, module: str, doc: str, role: str, serve) -> int:
    """A worker process's entry point (``python -m module``): parse its flags, reach node 0's store,
    ``serve(config, rank, device, host, port, store)``; a failure is written into the store (rank 0
    names it) and the process exits non-zero."""
    p = Parser(prog=f"python -m {module}", description=doc)
    p.add_argument("--rank", type=int, required=True, help=f"this {role}'s number (1 .. size - 1)")
    p.add_argument("--device", required=True, help=f"this {role}'s device, e.g. simxpu:1")
    p.add_argument("--store", required=True, help="HOST:PORT of node 0's rendezvous store")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # `kill -USR1 PID`: where every thread is
    config = EngineConfig.from_kwargs(**json.loads(args.config))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{role} {args.rank}] %(name)s: %(message)s")
    store = None
    try:
        host, port = parse_host_port(args.store, "--store")
        store = connect_store(host, port, config.dist_init_timeout)
        serve(config, args.rank, args.device, host, port, store)
        return 0
    except BaseException as e:  # report whatever it is to rank 0, then exit non-zero
        msg = str(e) if isinstance(e, PolychipError) else f"{type(e).__name__}: {e}"
        log.error("%s %d failed: %s", role, args.rank, msg)
        if store is not None and not isinstance(e, DuplicateRankError):   # the rank is another's
            try:
                report_failure(store, args.rank, msg)
            except Exception:  # rank 0 is gone too; the log line above is all we can do
                pass
        return 1


def run_node(config: EngineConfig) -> int:
    """Node ``node_rank > 0``: start this node's worker ranks and wait. Returns non-zero as soon as
    one fails (and ends the others); 0 when rank 0 stops them all."""
    world = World.from_config(config)
    if config.pp_size > 1:    # pipeline stages (engine/pipeline); tensor-parallel ranks otherwise
        from polychip.engine.pipeline.stages import node_devices
        devices, module, role = node_devices(config, world), "polychip.engine.pipeline.worker", "stage"
    else:
        devices, module, role = local_devices(config, world), "polychip.engine.tp_worker", "rank"
    host, port = rendezvous_address(config)
    log.info("node %d of %d: %ss %s on %s; rank 0 at %s:%d", world.node_rank, world.nnodes, role,
             world.local_ranks, devices, host, port)
    workers = LocalWorkers(config, world.local_ranks, devices, host, port, world_secret(config), module, role)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(POLL_PERIOD):
            done = workers.exited()
            bad = {r: c for r, c in done.items() if c != 0}
            if bad:
                r, code = next(iter(bad.items()))
                log.error("%s exited with code %d; stopping this node", workers.describe(r), code)
                return code if code > 0 else 1
            if len(done) == len(workers.procs):
                log.info("node %d: every rank finished", world.node_rank)
                return 0
        log.info("node %d: stopping on a signal", world.node_rank)
        return 0
    finally:
        workers.kill()
        for s, h in previous.items():
            signal.signal(s, h)
