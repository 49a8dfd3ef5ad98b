"""What the state store's keys hold: one pydantic model per kind of record, each with a ``schema``.

``schema`` is the record's major version. A change that only adds a field keeps it (an older
router ignores the field, repos.py logs it once); a change an older router would misread raises it,
and a router skips records of a newer major, saying so. A record stored before schemas existed
reads as schema 1.

  models/NAME            ModelRecord     weights, baseline, rollbacks (the rollout a router set)
  workloads/ID           WorkloadRecord  a workload as its host's router runs it (events bounded)
  batches/ID             BatchRecord     an online batch object (OpenAI's fields + the router's own)
  replicas/NODE/NAME     ReplicaRecord   the registry: a replica a router fronts (leased)
  members/NODE           MemberRecord    a live router (leased): when it started, its host
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class Record(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=False)
    SCHEMA: ClassVar[int] = 1

    schema_version: int = Field(1, alias="schema", ge=1)

    def stored(self) -> dict:
        """JSON-shaped, stamped with this router's schema."""
        return {**self.model_dump(mode="json", by_alias=True), "schema": self.SCHEMA}


class ModelRecord(Record):
    weights: dict[str, float]
    baseline: str | None = None
    rolled_back: dict[str, str] = Field(default_factory=dict)
    file_intent: str | None = None       # hash of the deployment file's entry the weights came from
    source: str = "?"                    # file, runtime (an operator), guard (the canary guard)
    by: str | None = None                # the node id of the router that wrote it
    at: float | None = None


class WorkloadEvent(BaseModel):
    model_config = ConfigDict(extra="ignore")
    at: str
    event: str
    detail: str = ""


class WorkloadRecord(Record):
    id: str
    spec: dict[str, Any]                 # a WorkloadSpec: validated by the workloads layer, strictly
    host: str
    devices: list[str]
    source: Literal["api", "deployment"] = "api"
    status: Literal["pending", "loading", "ready", "draining", "failed", "stopped"]
    restarts: int = 0
    created_at: float
    url: str | None = None
    events: list[WorkloadEvent] = Field(default_factory=list)
    events_dropped: int = 0              # the oldest events beyond the router's workload_events
    startup: dict[str, Any] | None = None
    first_token_s: float | None = None


class RequestCounts(BaseModel):
    model_config = ConfigDict(extra="ignore")
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchFiles(BaseModel):
    model_config = ConfigDict(extra="ignore")
    output: str | None = None
    error: str | None = None


class BatchRecord(Record):
    """OpenAI's batch object, and ``polychip``: the output and error files the runner appends to."""
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    polychip: BatchFiles = Field(default_factory=BatchFiles)

    def plain(self) -> dict:
        """The dict the batch runner works on (no schema: that is the store's)."""
        return self.model_dump(mode="json", exclude={"schema_version"})


class ReplicaRecord(Record):
    url: str
    model: str | None = None
    version: str | None = None
    launched: bool = False
    up: bool = False


class MemberRecord(Record):
    started: float
    host: str | None = None              # the host its workloads are placed on
