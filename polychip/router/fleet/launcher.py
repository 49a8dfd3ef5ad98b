"""Launches ``polychip serve`` replicas from a deployment and keeps them running: one that exits
is restarted with exponential backoff (reset after it ran a while), its output goes to its own
rotated file (``ReplicaLogs``; the router's log when there is none), ``on_event(name, kind,
detail)`` hears each start ("started", pid) and exit ("exited", the exit status), and ``stop``
sends SIGTERM (the replica drains) then kills it after a grace period.

A launched replica dies with the router: the kernel sends it SIGTERM when the router's process
goes, however it goes (``PR_SET_PDEATHSIG``, Linux). A replica without a fixed port binds port 0
itself and reports the port in its ready line, so no other process can take the port between
the router choosing it and the replica binding it; the port comes back through a pipe the
replica inherits, never from its output (processes.py). Its output is read in bounded lines, and
a leftover's stop waits in a thread, not on the event loop. Each running replica is recorded (pid and
command) under ``run_dir``; a new router that finds a record whose process still runs the same
command stops it before launching its own (a clean replacement, not a second set).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from polychip.errors import ConfigError
from polychip.http.launcher import VERSION_ENV
from polychip.http.serve_settings import parse_serve_args, replica_command
from polychip.http.server import PORT_FD_ENV, free_port
from polychip.router.deployment import ReplicaEntry
from polychip.router.fleet.processes import (bounded_lines, die_with_parent, exit_reason, read_port,
                                             running_cmd, stop_pid)
from polychip.trust.options import RouterTrust, TrustOptions

__all__ = ["Launcher", "Managed", "serve_command", "exit_reason", "default_run_dir"]

log = logging.getLogger("polychip.router.fleet.launcher")

BACKOFF_START, BACKOFF_MAX, STABLE_AFTER = 1.0, 30.0, 60.0
LEFTOVER_GRACE = 10.0         # seconds a previous router's replica gets to stop before SIGKILL


def default_run_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/polychip-{os.getuid()}"
    return Path(base) / "polychip-router"


def serve_command(entry: ReplicaEntry, port: int, dtype: str, quantization: str | None,
                  trust: TrustOptions | None = None) -> list[str]:
    """The replica's ``polychip serve`` command, built from validated serve settings: the entry's
    fields, then its ``args`` (read as serve settings), then ``trust``, the router's own trust
    options (applied last, so every replica checks against the same store); a guarded setting the
    router's trust does not allow is refused (ConfigError)."""
    trust = RouterTrust.of(trust)
    values = {"host": entry.host, "port": port, "served_model_name": entry.model, "device": entry.device,
              "model_path": entry.model_path, "dtype": dtype, "quantization": quantization,
              "tp_size": entry.tp_size, "device_config": entry.device_config}
    if entry.pp_devices:                        # a pipeline group, one process per stage behind one port
        values |= {"pp_size": len(entry.pp_devices), "pp_devices": ",".join(entry.pp_devices)}
    if entry.role is not None:                  # a side of a prefill/decode pair
        values |= {"disaggregation_mode": entry.role, "disaggregation_transfer_backend": entry.transfer_backend,
                   "disaggregation_host": entry.host}
        if entry.role == "prefill":
            values["disaggregation_bootstrap_port"] = entry.bootstrap_port or free_port(entry.host)
    values |= parse_serve_args(entry.args)
    refused = trust.refusals(values, f"replica {entry.name}: serve settings")
    if refused:
        raise ConfigError("; ".join(refused))
    return replica_command(values, trust)


@dataclass
class Managed:
    entry: ReplicaEntry
    port: int
    cmd: list[str]
    env: dict[str, str]
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    stopping: bool = False
    task: asyncio.Task | None = None
    started_at: float = 0.0
    exits: list[int] = field(default_factory=list)
    on_port: Callable[[int], None] | None = None     # told the port a replica bound (port 0)


class Launcher:
    def __init__(self, run_dir: Path | str | None = None, scope: str = "", logs=None, on_event=None,
                 trust: TrustOptions | None = None, leftover_grace: float = LEFTOVER_GRACE, on_failure=None):
        self.managed: dict[str, Managed] = {}
        self.on_failure = on_failure or (lambda name, error: None)   # the task supervisor's count
        key = hashlib.sha256(scope.encode()).hexdigest()[:16]      # one deployment's replicas
        self.run_dir = Path(run_dir or default_run_dir()) / key
        self.logs = logs              # ReplicaLogs, or None: output into the router's log
        self.on_event = on_event or (lambda name, kind, detail: None)
        self.trust = RouterTrust.of(trust)      # the router's trust options, for every replica it launches
        self.leftover_grace = leftover_grace

    def start(self, entry: ReplicaEntry, on_port: Callable[[int], None] | None = None) -> Managed:
        """Launch ``entry`` (with its dtype and quantization resolved) on its port; port 0 (none given):
        the replica binds a free port and ``on_port`` hears which."""
        port = entry.port or 0
        env = {**os.environ, **entry.env, VERSION_ENV: entry.version}
        m = Managed(entry, port, serve_command(entry, port, entry.dtype, entry.quantization, self.trust), env,
                    on_port=on_port)
        self.managed[entry.name] = m
        m.task = asyncio.ensure_future(self._keep_running(m))
        return m

    # records of running replicas, for the next router
    def _record_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.json"

    def _record(self, m: Managed) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._record_path(m.entry.name).write_text(json.dumps({"pid": m.proc.pid, "cmd": m.cmd}))

    def _unrecord(self, name: str) -> None:
        self._record_path(name).unlink(missing_ok=True)

    def replace_leftover(self, name: str, grace: float) -> int | None:
        """Stop what a previous router left running for replica ``name`` (its recorded pid, if
        that process still runs the recorded command); returns the pid stopped. It blocks up to
        ``grace`` + 5 s: the launcher runs it in a thread."""
        path = self._record_path(name)
        try:
            rec = json.loads(path.read_text())
            pid, old_cmd = int(rec["pid"]), list(rec["cmd"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        path.unlink(missing_ok=True)
        if running_cmd(pid) != old_cmd:
            return None             # gone, or the pid now belongs to something else
        log.warning("replica %s: a previous router left it running (pid %d); stopping it before launching "
                    "a new one", name, pid)
        stop_pid(pid, grace)
        return pid

    async def _keep_running(self, m: Managed) -> None:
        await asyncio.to_thread(self.replace_leftover, m.entry.name, self.leftover_grace)
        backoff = BACKOFF_START
        while not m.stopping:
            try:
                code = await self._run_once(m)
            except Exception as e:        # our bug or the OS's: named, counted, and the replica kept running
                code = -1
                log.error("replica %s: keep-alive failed: %s: %s", m.entry.name, type(e).__name__, e, exc_info=e)
                self.on_failure(f"replica {m.entry.name} keep-alive", e)
                if m.proc is not None and m.proc.returncode is None:
                    m.proc.kill()         # a run half watched is not kept: the next one starts clean
                    await m.proc.wait()
            m.exits.append(code)
            if m.stopping:
                break
            self.on_event(m.entry.name, "exited", code)
            if time.monotonic() - m.started_at > STABLE_AFTER:
                backoff = BACKOFF_START
            m.restarts += 1
            log.warning("replica %s exited with %s; restart %d in %.0fs", m.entry.name, code, m.restarts, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _run_once(self, m: Managed) -> int:
        """Start the replica once and watch it to its exit; its exit status (-1: it could not start)."""
        m.started_at = time.monotonic()
        port_read, port_write = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(*m.cmd, env={**m.env, PORT_FD_ENV: str(port_write)},
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT,
                                                        start_new_session=True, pass_fds=(port_write,),
                                                        preexec_fn=die_with_parent(os.getpid()))
        except OSError as e:
            proc = None
            log.error("replica %s: cannot start: %s", m.entry.name, e)
        finally:
            os.close(port_write)          # the child holds its own copy
        pipe = os.fdopen(port_read, "rb", buffering=0)
        if proc is None:
            pipe.close()
            return -1
        m.proc = proc
        return await self._watch(m, pipe)

    async def _watch(self, m: Managed, pipe) -> int:
        """One run of the replica: its port learnt from the pipe, its output logged; its exit status."""
        log.info("replica %s: started (pid %d, %s)", m.entry.name, m.proc.pid,
                 f"port {m.port}" if m.port else "binding a free port")
        self._record(m)
        self.on_event(m.entry.name, "started", m.proc.pid)
        port = asyncio.ensure_future(self._learn_port(m, pipe))
        try:
            await self._pipe_output(m)
            return await m.proc.wait()
        finally:
            port.cancel()
            await asyncio.gather(port, return_exceptions=True)
            pipe.close()

    async def _learn_port(self, m: Managed, pipe) -> None:
        """The port the replica reports through its pipe (the pipe is the only source)."""
        port = await read_port(pipe)
        if port is None:
            log.warning("replica %s closed its port pipe without a valid port", m.entry.name)
        elif m.on_port is not None:
            m.on_port(port)

    async def _pipe_output(self, m: Managed) -> None:
        out = self.logs.writer(m.entry.name) if self.logs else logging.getLogger(f"polychip.replica.{m.entry.name}")
        async for line in bounded_lines(m.proc.stdout):
            out.info("%s", line)

    async def stop(self, name: str, grace: float) -> None:
        """SIGTERM (the replica finishes what it has for its own grace period), then SIGKILL."""
        m = self.managed.pop(name, None)
        if m is None:
            return
        m.stopping = True
        proc = m.proc
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), grace)
            except ProcessLookupError:
                pass
            except asyncio.TimeoutError:
                log.warning("replica %s did not stop within %.0fs; killing it", name, grace)
                proc.kill()
                await proc.wait()
        if m.task is not None:
            m.task.cancel()
            await asyncio.gather(m.task, return_exceptions=True)
        self._unrecord(name)
        log.info("replica %s stopped", name)

    async def stop_all(self, grace: float) -> None:
        await asyncio.gather(*(self.stop(n, grace) for n in list(self.managed)))

    def pid(self, name: str) -> int | None:
        m = self.managed.get(name)
        return m.proc.pid if m and m.proc and m.proc.returncode is None else None

    def restarts(self, name: str) -> int:
        m = self.managed.get(name)
        return m.restarts if m else 0


