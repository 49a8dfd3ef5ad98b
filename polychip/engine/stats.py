"""What the engine tells the outside about itself: a stats snapshot and per-stage step time."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

#: the stages of ``Engine.step``, in order ("detokenize": the scheduler's update, whose
#: stop checks detokenize, and building the outputs)
STAGES = ("schedule", "prepare", "forward", "sample", "detokenize")


class StageTimer:
    """``with timer("forward"): ...`` adds the block's wall time to ``seconds["forward"]``.

    A device that runs asynchronously returns before its work is done, so its time would land in
    whichever later stage waits for it; with ``sync`` (the plugin's ``synchronize``, when profiling
    is on) each stage ends once the device has finished the work it launched."""

    def __init__(self, seconds: dict[str, float], sync: Callable[[], None] | None = None):
        self.seconds, self.sync = seconds, sync

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[stage] += perf_counter() - start


@dataclass(frozen=True)
class RankDevice:
    """One rank's device and memory (the engine's only one without tensor parallelism); ranks
    other than 0 as of their last heartbeat."""

    rank: int
    node: int
    plugin: str
    device: int                       # the plugin's device index
    free_memory: int                  # bytes
    total_memory: int
    kv_pool_bytes: int
    pid: int
    health: dict | None = None        # the plugin's health figures (API 1.2), None when it reports none
    # a pipeline stage's (engine/pipeline): its layers [start, end), micro-batches run, seconds computing
    stage: int | None = None
    layers: tuple[int, int] | None = None
    weight_bytes: int = 0             # the weights it holds
    micro_batches: int = 0
    busy_seconds: float = 0.0
    step_seconds: float = 0.0         # mean seconds of its layers per micro-batch

    @classmethod
    def of(cls, status: dict) -> "RankDevice":
        """From a rank's status dict (its heartbeat's JSON), keeping the fields this class knows."""
        known = {k: v for k, v in status.items() if k in cls.__dataclass_fields__}
        if known.get("layers") is not None:
            known["layers"] = tuple(known["layers"])
        return cls(**known)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the queue, the KV pool, the prefix cache, the counters since start and
    device memory, from ``Engine.stats()``."""

    num_waiting: int
    num_running: int
    page_size: int                    # tokens per KV page
    pages_total: int
    kv_pool_bytes: int                # bytes allocated for the pool
    pages_free: int
    pages_cached: int                 # held by the prefix cache
    pages_evictable: int              # cached and held by no running request
    kv_usage: float                   # fraction of pages in use (running or cached)
    prefix_cache_hit_rate: float      # prompt_tokens_cached / prompt_tokens_queried
    requests_added: int
    requests_aborted: int
    preemptions: int
    steps: int
    prompt_tokens: int                # prompt tokens computed (cache hits excluded, recomputes included)
    generation_tokens: int
    prompt_tokens_queried: int        # prompt tokens of admitted requests, each request once
    prompt_tokens_cached: int         # of those, served from the prefix cache
    spec_verify_steps: int            # speculative verify forwards (one per request and step with a draft)
    spec_draft_tokens: int            # draft tokens checked
    spec_accepted_tokens: int         # of those, kept
    stage_seconds: tuple[tuple[str, float], ...]          # (stage, seconds), in STAGES order
    device_memory: tuple[tuple[str, int, int], ...]       # (device label, free bytes, total bytes)
    ranks: tuple[RankDevice, ...] = ()                    # every tensor-parallel rank's device
    waiting_by_priority: tuple[tuple[int, int], ...] = ()  # (scheduler priority, waiting), lowest first
    # the host tier of the radix cache (--enable-hierarchical-cache), zero without it
    host_tier_pages: int = 0              # host pages it can hold
    host_tier_pages_used: int = 0
    host_hit_tokens: int = 0              # prompt tokens served by copying pages back from it
    host_tier_bytes_to_host: int = 0      # bytes copied device -> host (evictions)
    host_tier_bytes_to_device: int = 0    # bytes copied host -> device (hits)
