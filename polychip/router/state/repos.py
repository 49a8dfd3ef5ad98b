"""Tolerant readers of the typed records (records.py): a router reads what another router wrote,
maybe a newer or an older one, and a record it cannot read never stops it.

- an unknown field is ignored, and logged once per kind and field (a newer router added it);
- a record that does not validate is skipped, its key and reason logged once and counted;
- a record of a newer schema major is skipped with the versions named (upgrade this router).

``Unreadable`` keeps what was skipped, for /admin/state.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Generic, Iterable, TypeVar

from pydantic import ValidationError

from polychip.router.state.records import (BatchRecord, MemberRecord, ModelRecord, Record, ReplicaRecord,
                                           WorkloadRecord)

log = logging.getLogger("polychip.router.state")
R = TypeVar("R", bound=Record)


class Unreadable:
    """The records skipped now (key -> reason), how many were skipped since start, and the unknown
    fields seen ((prefix, field) pairs)."""

    def __init__(self):
        self.skipped: dict[str, str] = {}
        self.skips = 0
        self.unknown_fields: set[tuple[str, str]] = set()

    def skip(self, key: str, reason: str) -> None:
        """Counted and logged once per record and reason (a view is read again and again)."""
        if self.skipped.get(key) != reason:
            self.skipped[key] = reason
            self.skips += 1
            log.error("state: record %s skipped: %s", key, reason)

    def readable(self, key: str) -> None:
        self.skipped.pop(key, None)

    def unknown(self, prefix: str, fields: Iterable[str]) -> None:
        new = sorted({(prefix, f) for f in fields} - self.unknown_fields)
        if new:
            self.unknown_fields.update(new)
            log.warning("state: %s records carry field(s) %s this router does not know (a newer router wrote "
                        "them): ignored", prefix, [f for _, f in new])

    def describe(self) -> dict:
        return {"skipped": dict(self.skipped), "skips": self.skips,
                "unknown_fields": sorted(f"{p}{f}" for p, f in self.unknown_fields)}


def _known(model: type[Record]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def _problems(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'record'}: {e['msg']}" for e in err.errors()[:5])


class Repository(Generic[R]):
    """The records of one kind, under ``prefix``; ``check`` may refuse a record further (ValueError)."""

    def __init__(self, prefix: str, model: type[R], unreadable: Unreadable,
                 check: Callable[[R], Any] | None = None):
        self.prefix, self.model, self.unreadable, self.check = prefix, model, unreadable, check
        self._known = _known(model)

    def key(self, name: str) -> str:
        return self.prefix + name

    def decode(self, key: str, raw: Any) -> R | None:
        """The record stored at ``key``, or None (skipped: logged once, counted)."""
        if not isinstance(raw, dict):
            self.unreadable.skip(key, f"expected an object, found {type(raw).__name__}")
            return None
        schema = raw.get("schema", 1)
        if isinstance(schema, int) and schema > self.model.SCHEMA:
            self.unreadable.skip(key, f"schema {schema} is newer than this router reads ({self.model.SCHEMA}): "
                                      "a newer router wrote it; upgrade this one to read it")
            return None
        unknown = set(raw) - self._known
        if unknown:
            self.unreadable.unknown(self.prefix, unknown)
        try:
            record = self.model.model_validate(raw)
            if self.check is not None:
                self.check(record)
        except (ValidationError, ValueError, TypeError) as e:
            why = _problems(e) if isinstance(e, ValidationError) else f"{type(e).__name__}: {e}"
            self.unreadable.skip(key, f"not a readable {self.model.__name__}: {why}")
            return None
        self.unreadable.readable(key)
        return record

    def all(self, entries: Iterable[tuple[str, Any]]) -> dict[str, R]:
        """{name (the key without the prefix): record} of the readable ones among ``entries``."""
        out = {}
        for key, raw in entries:
            if key.startswith(self.prefix):
                record = self.decode(key, raw)
                if record is not None:
                    out[key[len(self.prefix):]] = record
        return out


class Repos:
    """The repositories a router reads and writes, sharing one Unreadable."""

    def __init__(self):
        self.unreadable = Unreadable()
        self.models = Repository("models/", ModelRecord, self.unreadable)
        self.workloads = Repository("workloads/", WorkloadRecord, self.unreadable)
        self.batches = Repository("batches/", BatchRecord, self.unreadable)
        self.replicas = Repository("replicas/", ReplicaRecord, self.unreadable)
        self.members = Repository("members/", MemberRecord, self.unreadable)
