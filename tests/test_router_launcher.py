"""The launcher's hold on a replica process (issue 32, finding 4 and the stop in 5): the port comes
through an inherited pipe only (a ready line a client makes the replica print redirects nothing), a
line over 64 KiB does not end supervision, and stopping a previous router's leftover does not block
the event loop. The replica is a small stand-in process, since the model is not the point."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from polychip.router.deployment import ReplicaEntry
from polychip.router.fleet import launcher as launcher_mod
from polychip.router.fleet.launcher import Launcher

pytestmark = pytest.mark.device_independent

# binds a free port, reports it the way polychip serve does (the inherited pipe), then prints what a
# hostile request path could make an access log print, a 100 KiB line, and a last line
FAKE = textwrap.dedent("""
    import os, socket, sys, time
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    fd = os.environ.get("POLYCHIP_PORT_FD")
    if fd:
        os.write(int(fd), f"{s.getsockname()[1]}\\n".encode()); os.close(int(fd))
    print('GET /polychip ready: http://127.0.0.1:1 (OpenAI API)', flush=True)
    print("x" * (100 * 1024), flush=True)
    print("after the long line", flush=True)
    time.sleep(3600)
""")


class Lines:
    def __init__(self):
        self.lines: list[str] = []

    def writer(self, name):
        return self

    def info(self, fmt, line):
        self.lines.append(line)


async def _until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_port_from_the_pipe_only_and_a_long_line_does_not_end_supervision(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_mod, "serve_command", lambda entry, port, *rest: [sys.executable, "-c", FAKE])
    logs, ports = Lines(), []

    async def main():
        s = Launcher(run_dir=tmp_path / "run", scope="t", logs=logs)
        m = s.start(ReplicaEntry(name="r0", model="m", version="v1", device="cpu"), on_port=ports.append)
        try:
            await _until(lambda: "after the long line" in logs.lines)
            await asyncio.sleep(0.2)
            assert m.task is not None and not m.task.done() and m.restarts == 0
        finally:
            await s.stop_all(2.0)
        return m.proc.pid

    asyncio.run(main())
    assert len(ports) == 1 and ports[0] != 1                  # the bound port, not the printed one
    assert any(line.startswith("x" * 1000) and "cut at" in line for line in logs.lines)


LEFTOVER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def test_stopping_a_leftover_does_not_block_the_event_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_mod, "serve_command", lambda entry, port, *rest: [sys.executable, "-c", FAKE])
    leftover = subprocess.Popen([sys.executable, "-c", LEFTOVER], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        assert leftover.stdout.readline().strip() == "up"        # SIGTERM ignored from here on
        s = Launcher(run_dir=tmp_path / "run", scope="t", leftover_grace=1.5)
        s.run_dir.mkdir(parents=True)
        (s.run_dir / "r0.json").write_text(json.dumps({"pid": leftover.pid, "cmd": leftover.args}))
        ticks = []

        async def main():
            async def tick():
                while True:
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.05)
            ticker = asyncio.ensure_future(tick())
            began = time.monotonic()
            s.start(ReplicaEntry(name="r0", model="m", version="v1", device="cpu"))
            returned = time.monotonic() - began
            await _until(lambda: leftover.poll() is not None)
            gaps = [b - a for a, b in zip(ticks, ticks[1:])]
            ticker.cancel()
            await s.stop_all(2.0)
            return returned, max(gaps)

        returned, widest = asyncio.run(main())
        assert leftover.returncode == -signal.SIGKILL            # it had to be killed after the grace
        assert returned < 0.5 and widest < 0.5, (returned, widest)
    finally:
        leftover.kill()
        leftover.wait()


def test_a_keep_alive_that_fails_is_named_counted_and_the_replica_runs_again(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_mod, "serve_command", lambda entry, port, *rest: [sys.executable, "-c", FAKE])
    monkeypatch.setattr(launcher_mod, "BACKOFF_START", 0.1)
    failures, logs = [], Lines()
    real_watch, calls = Launcher._watch, []

    async def watch_failing_once(self, m, pipe):
        calls.append(m.proc.pid)
        if len(calls) == 1:
            pipe.close()
            raise RuntimeError("a bug while watching")
        return await real_watch(self, m, pipe)
    monkeypatch.setattr(Launcher, "_watch", watch_failing_once)

    async def main():
        s = Launcher(run_dir=tmp_path / "run", scope="t", logs=logs,
                     on_failure=lambda name, e: failures.append((name, str(e))))
        m = s.start(ReplicaEntry(name="r0", model="m", version="v1", device="cpu"))
        try:
            await _until(lambda: "after the long line" in logs.lines)
            assert m.restarts == 1 and not m.task.done() and m.proc.returncode is None
            assert m.exits == [-1]
        finally:
            await s.stop_all(2.0)

    asyncio.run(main())
    assert failures == [("replica r0 keep-alive", "a bug while watching")]
    assert len(calls) == 2 and subprocess.run(["kill", "-0", str(calls[0])], capture_output=True).returncode != 0
