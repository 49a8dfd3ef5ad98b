"""Each launched replica's own output in its own file, ``DIR/NAME.log``, rotated by size
(the standard library's RotatingFileHandler: NAME.log.1 ... NAME.log.BACKUPS), so a chatty
replica cannot fill the disk and none is interleaved into the router's log.

``tail`` reads the last lines (through the rotated files when the current one is short);
``follow`` yields what is appended, across rotations (one rotation per 0.25 s poll is kept up
with: a replica writing more than the size cap in a quarter second loses lines in the follow,
not in the files).
"""
from __future__ import annotations

import asyncio
import logging
import logging.handlers
import os
import re
import tempfile
from collections import deque

from polychip.errors import ConfigError

log = logging.getLogger("polychip.router")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FOLLOW_POLL = 0.25            # seconds between looks at a followed file


class ReplicaLogs:
    def __init__(self, directory: str, max_bytes: int = 10 * 2**20, backups: int = 3):
        if max_bytes < 1024 or backups < 1:
            raise ConfigError(f"replica logs need max_bytes >= 1024 and backups >= 1, got {max_bytes}, {backups}")
        self.dir, self.max_bytes, self.backups = directory, max_bytes, backups
        os.makedirs(directory, exist_ok=True)
        self._writers: dict[str, logging.Logger] = {}

    @classmethod
    def for_router(cls, cfg) -> "ReplicaLogs":
        """Launched replicas' own log files: under the state dir, else a fresh folder for this router."""
        where = (os.path.join(cfg.state_dir, "replica-logs") if cfg.state_dir
                 else tempfile.mkdtemp(prefix="polychip-replica-logs-"))
        log.info("launched replicas log to %s/NAME.log (rotated at %d bytes)", where, cfg.replica_log_max_bytes)
        return cls(where, cfg.replica_log_max_bytes, cfg.replica_log_backups)

    def path(self, name: str) -> str:
        if not _NAME.match(name):
            raise ConfigError(f"replica log name {name!r}: expected letters, digits, '.', '_' or '-'")
        return os.path.join(self.dir, f"{name}.log")

    def writer(self, name: str) -> logging.Logger:
        """A logger that writes plain lines to NAME.log (not propagated to the router's log)."""
        if name not in self._writers:
            handler = logging.handlers.RotatingFileHandler(self.path(name), maxBytes=self.max_bytes,
                                                           backupCount=self.backups, encoding="utf-8")
            handler.setFormatter(logging.Formatter("%(message)s"))
            out = logging.getLogger(f"polychip.replica_log.{name}")
            out.handlers[:] = [handler]
            out.setLevel(logging.INFO)
            out.propagate = False
            self._writers[name] = out
        return self._writers[name]

    def close(self, name: str) -> None:
        out = self._writers.pop(name, None)
        for h in out.handlers if out else ():
            h.close()
        if out:
            out.handlers.clear()

    def files(self, name: str) -> list[str]:
        """Oldest first: NAME.log.N ... NAME.log.1, NAME.log (those that exist)."""
        base = self.path(name)
        olds = [f"{base}.{i}" for i in range(self.backups, 0, -1)]
        return [p for p in olds + [base] if os.path.exists(p)]

    def tail(self, name: str, n: int) -> list[str]:
        last: deque[str] = deque(maxlen=max(n, 0))
        for p in self.files(name):
            with open(p, encoding="utf-8", errors="replace") as f:
                last.extend(line.rstrip("\n") for line in f)
        return list(last)

    async def follow(self, name: str, n: int, alive=lambda: True):
        """The last ``n`` lines, then each line appended, while ``alive()``; survives rotation."""
        for line in self.tail(name, n):
            yield line + "\n"
        base = self.path(name)
        f, ino = self._open_end(base)
        try:
            while alive():
                chunk = f.readline() if f else ""
                if chunk:
                    yield chunk
                    continue
                await asyncio.sleep(FOLLOW_POLL)
                now = os.stat(base).st_ino if os.path.exists(base) else None
                if now != ino:            # rotated (or created): the rest of the old file, then the new one
                    rest = f.read() if f else ""
                    if rest:
                        yield rest
                    if f:
                        f.close()
                    f, ino = (open(base, encoding="utf-8", errors="replace"), now) if now else (None, None)
        finally:
            if f:
                f.close()

    @staticmethod
    def _open_end(path: str):
        if not os.path.exists(path):
            return None, None
        f = open(path, encoding="utf-8", errors="replace")
        f.seek(0, os.SEEK_END)
        return f, os.fstat(f.fileno()).st_ino
