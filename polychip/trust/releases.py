"""``releases.json`` beside a trust store's ``trust.yaml``: the highest release of each model seen
on this host ({model name: {release, manifest_sha256, package, seen}}), so an older one is refused.

The file is the only thing of the store the serving user writes: it is updated in place under an
exclusive ``fcntl`` lock (read, merge, rewrite, fsync), so writers in several processes lose
nothing and the store's folder (and ``trust.yaml``) can stay read-only to that user. Readers take
the shared lock, so they never see a half-written file. It is created 0644 when missing (the
folder must then be writable once; ``polychip trust init`` creates it).
"""
from __future__ import annotations

import fcntl
import json
import os
import time

from polychip.errors import ConfigError

RELEASES_FILE = "releases.json"
MODE = 0o644


class Releases:
    def __init__(self, folder: str):
        self.path = os.path.join(folder, RELEASES_FILE)

    def read(self) -> dict:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise ConfigError(f"{self.path}: cannot read the releases seen ({e})") from None
        with os.fdopen(fd, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            return self._parse(f.read())

    def _parse(self, data: bytes) -> dict:
        if not data.strip():
            return {}
        try:
            seen = json.loads(data)
        except ValueError as e:
            raise ConfigError(f"{self.path}: cannot read the releases seen ({e})") from None
        if not isinstance(seen, dict) or not all(isinstance(v, dict) and isinstance(v.get("release"), int)
                                                 for v in seen.values()):
            raise ConfigError(f"{self.path}: expected {{model name: {{release: N, ...}}}}")
        return seen

    def record(self, name: str, number: int, manifest_sha256: str, package: str) -> bool:
        """Remember ``number`` if it is the highest of ``name``; True when it was written."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, MODE)
        except OSError as e:
            raise ConfigError(f"{self.path}: cannot record release {number} of {name!r} ({e}); the serving "
                              f"user must be able to write this one file of the trust store") from None
        with os.fdopen(fd, "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            seen = self._parse(f.read())
            if name in seen and seen[name]["release"] >= number:
                return False
            seen[name] = {"release": number, "manifest_sha256": manifest_sha256, "package": os.path.abspath(package),
                          "seen": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            f.seek(0)
            f.truncate()
            f.write(json.dumps(seen, indent=2, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
        return True
