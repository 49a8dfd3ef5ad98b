"""A registry that counts the calls of every op it resolves, for ``polychip coverage``.

Load a model with it, run one real forward, then read ``calls``: the ops the forward used,
with the dtype each was resolved for. Only the coverage path pays for the wrapper.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from polychip.ops.registry import OpRegistry, Resolution


class RecordingRegistry(OpRegistry):
    def __init__(self, plugin_name: str = "native"):
        super().__init__(plugin_name)
        self.calls: Counter = Counter()      # (name, version, dtype) -> number of calls

    def resolve(self, name: str, version: int, dtype: str) -> Resolution:
        res = super().resolve(name, version, dtype)
        key, fn, calls = (name, version, dtype), res.fn, self.calls

        def recorded(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return dataclasses.replace(res, fn=recorded)

    def used(self) -> list[tuple[Resolution, int]]:
        """(resolution, calls) for every op the recorded forward called, in first-resolved order."""
        return [(r, self.calls[(r.name, r.version, r.dtype)]) for r in self.resolutions()
                if self.calls[(r.name, r.version, r.dtype)]]
