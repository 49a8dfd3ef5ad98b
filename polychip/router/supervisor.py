"""Launches ``polychip serve`` replicas from a deployment and keeps them running: one that exits
is restarted with exponential backoff (reset after it ran a while), its output goes to the
router's log under its name, and ``stop`` sends SIGTERM (the replica drains) then kills it
after a grace period.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field

from polychip.http.launcher import VERSION_ENV, serve_command as serve_argv
from polychip.router.deployment import ReplicaEntry

log = logging.getLogger("polychip.router.supervisor")

BACKOFF_START, BACKOFF_MAX, STABLE_AFTER = 1.0, 30.0, 60.0


def serve_command(entry: ReplicaEntry, port: int, dtype: str, quantization: str | None) -> list[str]:
    cmd = serve_argv(entry.host, port, ["--served-model-name", entry.model, "--device", entry.device])
    if entry.model_path:
        cmd += ["--model-path", entry.model_path]
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    if quantization:
        cmd += ["--quantization", quantization]
    if entry.tp_size > 1:
        cmd += ["--tp-size", str(entry.tp_size)]
    if entry.device_config:
        cmd += ["--device-config", entry.device_config]
    return cmd + list(entry.args)


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


class Supervisor:
    def __init__(self):
        self.managed: dict[str, Managed] = {}

    def start(self, entry: ReplicaEntry, port: int, dtype: str, quantization: str | None) -> Managed:
        env = {**os.environ, **entry.env, VERSION_ENV: entry.version}
        m = Managed(entry, port, serve_command(entry, port, dtype, quantization), env)
        self.managed[entry.name] = m
        m.task = asyncio.ensure_future(self._keep_running(m))
        return m

    async def _keep_running(self, m: Managed) -> None:
        backoff = BACKOFF_START
        while not m.stopping:
            m.started_at = time.monotonic()
            try:
                m.proc = await asyncio.create_subprocess_exec(*m.cmd, env=m.env, stdout=asyncio.subprocess.PIPE,
                                                              stderr=asyncio.subprocess.STDOUT,
                                                              start_new_session=True)
            except OSError as e:
                log.error("replica %s: cannot start: %s", m.entry.name, e)
                code = -1
            else:
                log.info("replica %s: started (pid %d, port %d)", m.entry.name, m.proc.pid, m.port)
                await self._pipe_output(m)
                code = await m.proc.wait()
            m.exits.append(code)
            if m.stopping:
                break
            if time.monotonic() - m.started_at > STABLE_AFTER:
                backoff = BACKOFF_START
            m.restarts += 1
            log.warning("replica %s exited with %s; restart %d in %.0fs", m.entry.name, code, m.restarts, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _pipe_output(self, m: Managed) -> None:
        out = logging.getLogger(f"polychip.replica.{m.entry.name}")
        async for raw in m.proc.stdout:
            out.info("%s", raw.decode(errors="replace").rstrip())

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
        log.info("replica %s stopped", name)

    async def stop_all(self, grace: float) -> None:
        await asyncio.gather(*(self.stop(n, grace) for n in list(self.managed)))

    def pid(self, name: str) -> int | None:
        m = self.managed.get(name)
        return m.proc.pid if m and m.proc and m.proc.returncode is None else None
