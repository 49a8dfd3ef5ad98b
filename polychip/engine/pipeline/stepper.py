"""Stage 0's step under pipeline parallelism: micro-batches in flight between the stages.

``step()`` first fills the pipeline: while fewer than ``depth`` micro-batches are in flight it asks
the scheduler for one more (requests in flight are neither scheduled again nor preempted, and one
micro-batch takes at most its share of the requests, so decodes spread over the stages), runs
stage 0's layers on it and sends it on. Then it lands the oldest: the last stage returns the
hidden rows to sample, stage 0 turns them into logits, samples, and books the step as one device
would. Each stage runs micro-batches in the order they were sent, so a KV page freed while a
micro-batch that wrote it is in flight (an abort) is rewritten only after that micro-batch passed.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from polychip.engine.pipeline.runner import FirstStageRunner
from polychip.engine.request import Request
from polychip.engine.scheduler import SchedulerOutput


@dataclass
class MicroBatch:
    seq: int
    sched: SchedulerOutput
    sample_reqs: list[Request]
    ids: frozenset[str]


class PipelineStepper:
    def __init__(self, engine, runner: FirstStageRunner, group):
        self.engine, self.runner, self.group = engine, runner, group
        self.depth, self.timeout_s = group.depth, group.config.dist_timeout
        self.in_flight: deque[MicroBatch] = deque()
        self._seq = 0

    @property
    def busy(self) -> frozenset[str]:
        return frozenset().union(*(mb.ids for mb in self.in_flight))

    def _share(self) -> int:
        """The most requests one micro-batch takes: the requests there are, spread over ``depth``."""
        s = self.engine.scheduler
        return max(1, math.ceil((len(s.running) + len(s.waiting)) / self.depth))

    def step(self) -> list:
        eng, timer, outputs = self.engine, self.engine._timer, []
        if self.group.fault is not None:
            raise self.group.error(f"pipeline group failed: {self.group.fault}")
        try:
            while len(self.in_flight) < self.depth:
                with timer("schedule"):
                    sched = eng.scheduler.schedule(self.busy, self._share())
                if not sched.scheduled:
                    if sched.unservable or sched.preempted:
                        with timer("detokenize"):
                            outputs += eng.finish_step(sched, [], [], [])
                    break
                with timer("prepare"):
                    batch = self.runner.prepare(sched.scheduled)
                with timer("forward"):
                    self.runner.launch(batch, self._seq)
                self.in_flight.append(MicroBatch(self._seq, sched, batch.sample_reqs,
                                                 frozenset(r.request_id for r, _ in sched.scheduled)))
                self._seq += 1
            if self.in_flight:
                outputs += self._land(self.in_flight[0])
                self.in_flight.popleft()
        except RuntimeError as e:     # gloo/nccl report a lost or hung peer as RuntimeError subclasses
            raise self.group.link_failure(e) from None
        return outputs

    def _land(self, mb: MicroBatch) -> list:
        eng, timer = self.engine, self.engine._timer
        with timer("forward"):
            logits = self.runner.land(mb.seq, len(mb.sample_reqs), self.timeout_s)
        tokens, logprobs, sampled = [], [], []
        with timer("sample"):
            live = [i for i, r in enumerate(mb.sample_reqs) if not r.finished]   # aborted in flight: dropped
            if live:
                sampled = [mb.sample_reqs[i] for i in live]
                rows = logits if len(live) == len(mb.sample_reqs) else logits[live]
                tokens, logprobs = eng._sample(rows, sampled)
        with timer("detokenize"):
            return eng.finish_step(mb.sched, sampled, tokens, logprobs)

    def drain(self) -> None:
        """Land what is in flight, dropping its results (before the stages are told to stop)."""
        while self.in_flight:
            mb = self.in_flight.popleft()
            self.runner.land(mb.seq, len(mb.sample_reqs), self.timeout_s)
