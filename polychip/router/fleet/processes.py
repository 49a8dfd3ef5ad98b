"""What the launcher does to a child process, apart from keeping it running: arm it to die with the
router, learn the port it bound through an inherited pipe, read its output in bounded lines, and
stop a process a previous router left (blocking: the launcher runs it in a thread).

The port comes through a pipe whose write end the child inherits (its fd number in
``PORT_FD_ENV``; ``polychip serve`` writes the port there once it listens, ``http/server.py``),
never from its output: the output carries request paths and other text a client controls.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import time
from pathlib import Path
from typing import AsyncIterator, Callable

PR_SET_PDEATHSIG = 1
MAX_LINE = 64 * 1024          # bytes of one output line kept; the rest of a longer line is dropped
READ_CHUNK = 16 * 1024
PORT_REPORT_MAX = 16          # bytes: "65535\n" fits


def die_with_parent(parent: int) -> Callable[[], None]:
    """preexec_fn: SIGTERM when the router dies (and exit now if it already has)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def arm():
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            os._exit(121)
        if os.getppid() != parent:          # the router died before prctl took effect
            os._exit(122)
    return arm


async def read_port(pipe) -> int | None:
    """The port a child writes to ``pipe`` (the read end's file object; closed here), or None when the
    child closes it without a valid one (it died first, or wrote something else)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=PORT_REPORT_MAX)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                pipe)
    try:
        raw = await reader.readuntil(b"\n")
        port = int(raw.strip())
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
        return None
    finally:
        transport.close()
    return port if 0 < port < 65536 else None


async def bounded_lines(stream: asyncio.StreamReader, max_line: int = MAX_LINE) -> AsyncIterator[str]:
    """The lines of ``stream`` (decoded, without their end), read in chunks: a line longer than
    ``max_line`` bytes is cut there (marked) and the rest of it skipped, so no line ends the reading."""
    buffer, skipping = b"", False
    while True:
        chunk = await stream.read(READ_CHUNK)
        if not chunk:
            if buffer and not skipping:
                yield buffer.decode(errors="replace").rstrip()
            return
        buffer += chunk
        while True:
            end = buffer.find(b"\n")
            if end < 0:
                break
            line, buffer = buffer[:end], buffer[end + 1:]
            if skipping:
                skipping = False
            else:
                yield line.decode(errors="replace").rstrip()
        if len(buffer) > max_line:
            if not skipping:
                yield buffer[:max_line].decode(errors="replace") + f" [line cut at {max_line} bytes]"
            buffer, skipping = b"", True


def running_cmd(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a] or None


def stop_pid(pid: int, grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds. It blocks: call it off the event loop."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if running_cmd(pid) is None or is_zombie(pid):
                return
            time.sleep(0.05)


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def exit_reason(code: int) -> str:
    """'exit status 1' or 'killed by SIGKILL' for a subprocess return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
