"""A workload: one replica this router launches on devices of its host, with its life as events.

Two kinds, one life: a submitted or declared workload (``spec``: a WorkloadSpec, the operator's model on
a device or device type) and a deployment file's replica with a device (``entry``: its ReplicaEntry, as
the file gives it). Both are placed on devices held in the ledger, launched, health-checked and stopped
the same way (workloads.py). Only spec'd workloads are stored (state/records.py's WorkloadRecord); a
deployment's replica is launched again from its file.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

from polychip.router.deployment import ReplicaEntry
from polychip.router.fleet.ledger import Reservation
from polychip.router.state.records import WorkloadRecord
from polychip.router.workload_spec import WorkloadSpec

STATUSES = ("pending", "loading", "ready", "draining", "failed", "stopped")
HOST_DOWN = "host_down"     # shown (never stored) for a record whose host has no live router


def stamp(t: float | None = None) -> str:
    """UTC ISO-8601 with milliseconds (sorts as text)."""
    return datetime.datetime.fromtimestamp(time.time() if t is None else t, datetime.timezone.utc) \
        .isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Workload:
    id: str
    spec: WorkloadSpec | None
    host: str
    devices: list[str]
    source: str = "api"                 # "api" (submitted) or "deployment" (declared in the file)
    status: str = "pending"
    restarts: int = 0
    created_at: float = field(default_factory=time.time)
    url: str | None = None
    events: list[dict] = field(default_factory=list)
    events_dropped: int = 0             # the oldest events, beyond the router's workload_events
    startup: dict | None = None         # the replica's /server_info "startup" block
    first_token_s: float | None = None
    host_up: bool = True                # not stored: whether its host has a live router now
    entry: ReplicaEntry | None = None   # a deployment file's replica (its dtype and quantization resolved)
    reservation: Reservation | None = None     # its devices in the ledger while it holds them

    # what it serves, from the spec or the file's entry
    @property
    def served_name(self) -> str:
        return self.spec.served_name if self.spec else self.entry.model

    @property
    def version(self) -> str:
        return self.spec.version if self.spec else self.entry.version

    @property
    def model_path(self) -> str | None:
        return self.spec.model if self.spec else self.entry.model_path

    @property
    def device_type(self) -> str:
        return self.spec.wanted_type if self.spec else self.entry.device.partition(":")[0]

    @property
    def stored(self) -> bool:
        """Kept in the state store (a deployment's replica is not: its file declares it again)."""
        return self.spec is not None

    @property
    def holding(self) -> bool:
        return self.reservation is not None and not self.reservation.released

    def launch_entry(self, bind_host: str) -> ReplicaEntry:
        """What the launcher starts: the file's entry, or one made from the spec (port 0: a free one)."""
        if self.entry is not None:
            return self.entry
        spec, kind = self.spec, self.devices[0].partition(":")[0]
        return ReplicaEntry(name=self.id, model=spec.served_name, version=spec.version,
                            device=kind if kind == "cpu" else self.devices[0], model_path=spec.model, dtype=spec.dtype,
                            quantization=spec.quantization, tp_size=spec.tp_size, host=bind_host,
                            args=spec.serve_flags())

    # events
    def event(self, kind: str, detail: str = "", at: float | None = None) -> None:
        self.events.append({"at": stamp(at), "event": kind, "detail": detail})
        self.events.sort(key=lambda e: e["at"])

    def has_event(self, kind: str) -> bool:
        return any(e["event"] == kind for e in self.events)

    def keep_events(self, keep: int) -> None:
        """The last ``keep`` events stay; the record counts the ones dropped."""
        if len(self.events) > keep:
            self.events_dropped += len(self.events) - keep
            del self.events[:-keep]

    # records
    def record(self) -> dict:
        return WorkloadRecord(id=self.id, spec=self.spec.model_dump(), host=self.host, devices=self.devices,
                              source=self.source, status=self.status, restarts=self.restarts,
                              created_at=self.created_at, url=self.url, events=self.events,
                              events_dropped=self.events_dropped, startup=self.startup,
                              first_token_s=self.first_token_s).stored()

    @classmethod
    def from_record(cls, record: dict | WorkloadRecord) -> "Workload":
        """A stored record (its spec validated like a submitted one: a ValidationError if not)."""
        r = record if isinstance(record, WorkloadRecord) else WorkloadRecord.model_validate(record)
        return cls(r.id, WorkloadSpec.model_validate(r.spec), r.host, list(r.devices), r.source, r.status,
                   r.restarts, r.created_at, r.url, [e.model_dump() for e in r.events], r.events_dropped,
                   r.startup, r.first_token_s)

    # views
    def view(self) -> dict:
        """``status`` is ``host_down`` for a live record whose host's router is gone (``last_status``:
        what that router last wrote)."""
        down = not self.host_up and self.status != "stopped"
        return {"id": self.id, "model": self.served_name, "model_path": self.model_path,
                "version": self.version, "host": self.host, "devices": self.devices,
                "device_type": self.device_type, "status": HOST_DOWN if down else self.status,
                "host_up": self.host_up, "last_status": self.status, "restarts": self.restarts,
                "age_s": round(time.time() - self.created_at, 1), "url": self.url, "source": self.source,
                "kind": "workload" if self.spec else "deployment replica"}

    def detail(self) -> dict:
        s = self.startup or {}
        target = (self.spec.device or self.spec.device_type) if self.spec else self.entry.device
        spec = self.spec.model_dump() if self.spec else self.entry.model_dump(exclude={"env"})    # env may hold secrets
        return {**self.view(), "target_device": target, "spec": spec, "events": self.events,
                "load_s": s.get("load"), "compile_s": s.get("compile"), "warmup_s": s.get("warmup"),
                "first_token_s": self.first_token_s, "events_dropped": self.events_dropped}
