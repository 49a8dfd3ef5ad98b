"""Where workload records are kept: the part of the router's state store interface
(``put``, ``delete``, ``list(prefix)``) the workloads use, with two small backends until the
shared store (router/state/) takes over: in memory, or one JSON file written atomically.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any, NamedTuple, Protocol


class Entry(NamedTuple):
    key: str
    value: Any


class KeyValue(Protocol):
    def put(self, key: str, value: Any) -> int: ...
    def delete(self, key: str) -> bool: ...
    def list(self, prefix: str) -> tuple[list, int]: ...


class MemoryKV:
    def __init__(self):
        self._data: dict[str, Any] = {}
        self._rev = 0
        self._lock = threading.Lock()

    def put(self, key: str, value: Any) -> int:
        json.dumps(value)                      # JSON-shaped, as the shared store requires
        with self._lock:
            self._data[key] = value
            self._rev += 1
            self._saved()
            return self._rev

    def delete(self, key: str) -> bool:
        with self._lock:
            gone = self._data.pop(key, None) is not None
            self._rev += gone
            if gone:
                self._saved()
            return gone

    def list(self, prefix: str) -> tuple[list[Entry], int]:
        with self._lock:
            return [Entry(k, v) for k, v in sorted(self._data.items()) if k.startswith(prefix)], self._rev

    def _saved(self) -> None:
        """Called under the lock after each change (the file backend writes through)."""


class JsonFileKV(MemoryKV):
    """MemoryKV written through to ``path`` (tmp file + rename) and loaded from it at start."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                self._data = json.load(f)

    def _saved(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
