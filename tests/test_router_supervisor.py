"""Replicas a router launches (issue 23, the process part of fault 5): they die with the router
however it dies, they bind their own port and report it, and a new router stops what an old one
left running instead of launching a second set. The replica here is a small stand-in process
(``serve_command`` swapped), since the model is not the point."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from router_helpers import wait_for

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)

# a stand-in for `polychip serve`: binds the port it is given (0: a free one), writes its pid and
# port, prints the ready line polychip serve prints, and waits
FAKE_SERVE = textwrap.dedent("""
    import socket, sys, time, os
    s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
    port = s.getsockname()[1]
    open(sys.argv[2], "w").write(f"{os.getpid()} {port}")
    print(f"polychip ready: http://127.0.0.1:{port} (OpenAI API at http://127.0.0.1:{port}/v1)", flush=True)
    time.sleep(3600)
""")

# a router process stand-in: the real Launcher launching one replica from a deployment entry
ROUTER = textwrap.dedent("""
    import asyncio, sys
    from polychip.router.fleet import launcher as sup
    from polychip.router.deployment import ReplicaEntry
    fake, info, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    sup.serve_command = lambda entry, port, *rest: [sys.executable, "-c", fake, str(port), info]
    async def main():
        s = sup.Launcher(run_dir=run_dir, scope="deploy.yaml")
        s.start(ReplicaEntry(name="r0", model="m", version="v1", device="cpu"))
        print("launched", flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _launch_router(tmp_path, tag: str):
    info = tmp_path / f"replica-{tag}.txt"
    proc = subprocess.Popen([sys.executable, "-c", ROUTER, FAKE_SERVE, str(info), str(tmp_path / "run")],
                            env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: info.exists() and info.read_text().count(" ") == 1, 30, "the replica's pid and port")
    pid, port = map(int, info.read_text().split())
    return proc, pid, port


def _cleanup(*pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_launched_replica_dies_when_its_router_is_killed(tmp_path):
    router, pid, port = _launch_router(tmp_path, "a")
    try:
        assert port != 0 and _alive(pid)
        router.kill()                      # SIGKILL: no chance to stop its replicas itself
        router.wait()
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"\nfault 5: replica alive 5 s after its router's SIGKILL: {_alive(pid)}")
        assert not _alive(pid)
    finally:
        _cleanup(pid)


def test_a_new_router_replaces_what_an_old_one_left_and_ports_are_reported(tmp_path):
    from polychip.router.fleet.launcher import Launcher
    # a replica an old router left: the record names its pid and command (as if pdeathsig were lost)
    leftover = subprocess.Popen([sys.executable, "-c", FAKE_SERVE, "0", str(tmp_path / "old.txt")],
                                start_new_session=True, stdout=subprocess.DEVNULL)
    router = pid = None
    try:
        wait_for(lambda: (tmp_path / "old.txt").exists(), 30, "the leftover replica")
        old = Launcher(run_dir=tmp_path / "run", scope="deploy.yaml")
        old.run_dir.mkdir(parents=True)
        (old.run_dir / "r0.json").write_text(json.dumps({"pid": leftover.pid, "cmd": leftover.args}))
        router, pid, port = _launch_router(tmp_path, "b")
        leftover.wait(15)
        assert leftover.returncode is not None and _alive(pid)
        print(f"\nfault 5: leftover replica replaced (exit {leftover.returncode}); the new one bound port {port}")
        rec = json.loads((old.run_dir / "r0.json").read_text())
        assert rec["pid"] == pid and "0" in rec["cmd"]          # launched with port 0: it bound its own
    finally:
        if router is not None:
            router.kill()
            router.wait()
        _cleanup(*(p for p in (pid, leftover.pid) if p))
