"""Request: one sequence's tokens, pages, progress, output state and timings."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from polychip.engine.sampling_params import SamplingParams
from polychip.models.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]          # (token id, logprob) alternatives, best first


@dataclass
class Timings:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def tpot(self, num_output: int) -> float | None:
        if self.finished is None or self.first_token is None or num_output < 2:
            return None
        return (self.finished - self.first_token) / (num_output - 1)


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, priority: int = 0,
                 generator: torch.Generator | None = None, arrival: float | None = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.generator = generator
        self.skip_draws = 0                 # draws a continued answer's earlier tokens took (sampler)
        self.detok = detokenizer
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served from the prefix cache
        self.pages: list[int] = []
        self.cache_node = None              # locked radix node
        self.num_preemptions = 0
        self.logprobs: list[TokenLogprob] = []
        self.text = ""                      # output text, stop strings applied
        self.emitted = 0                    # chars of ``text`` already streamed
        self.emitted_tokens = 0             # output ids already reported as deltas
        self.emitted_logprobs = 0
        self.matcher = None                 # xgrammar matcher when the request has a grammar
        self.grammar_failed = False         # the grammar refused a sampled token
        self.spec = None                    # spec_decode.SpecState when the request may speculate
        self.draft: list[int] = []          # draft tokens scheduled after its last token this step
        self.handoff = None                 # engine.disagg: a prefill side's Outbound of this request's KV
        self.timings = Timings(arrival if arrival is not None else time.monotonic())

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """(prompt + output)[start:end] without building the whole list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, pages={len(self.pages)})")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step (or at the end)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    prompt: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
