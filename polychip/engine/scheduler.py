"""Continuous batching with one rule: each request closes the gap between
``num_computed_tokens`` and its length, under a per-step token budget.

Prefill chunks, prefix-cache hits and decodes are the same thing here. When
pages run out, the lowest-priority running request is preempted and later
recomputed (its finished pages stay in the prefix cache while memory allows).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from polychip.engine.page_manager import PageManager
from polychip.engine.request import Request, Status, TokenLogprob
from polychip.engine.stop import check_stop

log = logging.getLogger("polychip.scheduler")

#: pages a decoding request takes at a time while the pool has room for every running request to: one run
#: of ids, read as one stream by the CPU decode attention (1.1x a single run's time, against 1.5-1.9x with
#: a page of its own every 16 tokens; PageAllocator)
RUN_PAGES = 8


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)   # decodes first
    preempted: list[Request] = field(default_factory=list)
    unservable: list[Request] = field(default_factory=list)   # cannot grow even alone in the pool
    num_prompt_tokens: int = 0          # prompt tokens this step computes
    prompt_tokens_queried: int = 0      # prompt tokens of requests admitted for the first time
    prompt_tokens_cached: int = 0       # of those, served from the prefix cache

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, pages: PageManager, token_budget: int, max_running: int, policy: str = "fcfs", *,
                 eos_ids: frozenset[int] = frozenset(), max_model_len: int, proposer=None):
        """``proposer``: a ``spec_decode.NgramProposer`` when speculative decoding is on."""
        self.pages, self.page = pages, pages.page_size
        self.budget, self.max_running, self.policy = token_budget, max_running, policy
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.proposer = proposer
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # prefill/decode hand-offs (engine/disagg): a prefill side's finished requests whose pages stay
        # until the decode side acknowledges, and a decode side's requests whose KV is on its way
        self.held: dict[str, Request] = {}
        self.receiving: dict[str, Request] = {}

    # queue management
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        return next((r for r in self.running + self.waiting if r.request_id == request_id),
                    self.receiving.get(request_id))

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request and release what it holds; a prefill side's request that
        hands its KV over keeps its pages (``held``) until ``release_held``."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.receiving.pop(req.request_id, None)
        if self.proposer is not None:
            self.proposer.finished(req)
        if req.handoff is not None and req.finish_reason != "abort" and req.output_ids:
            self.held[req.request_id] = req
        else:
            self.pages.release(req)
        req.status = Status.FINISHED
        req.timings.finished = time.monotonic()

    # prefill/decode hand-offs (engine/disagg)
    def release_held(self, request_id: str) -> bool:
        """The decode side has the KV of held request ``request_id`` (or gave up): free its pages."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.pages.release(req)
        return req is not None

    def reserve(self, req: Request) -> bool:
        """Give ``req`` fresh pages for its whole prompt, to receive its KV into; False (nothing taken)
        when the pool cannot give them now."""
        need = self.pages.pages_for(len(req.prompt_ids))
        if not self.pages.can_allocate(need):
            return False
        req.pages = self.pages.allocate(need)
        self.receiving[req.request_id] = req
        return True

    def land(self, req: Request, first_token: int, logprob: TokenLogprob | None) -> None:
        """``req``'s prompt KV is in its pages and the prefill side sampled ``first_token``: it decodes
        from here as if it had run its prefill in this engine."""
        del self.receiving[req.request_id]
        req.num_computed_tokens = len(req.prompt_ids)
        req.status = Status.RUNNING
        self.running.append(req)
        self.pages.cache_progress(req)
        req.timings.first_scheduled = req.timings.first_token = time.monotonic()
        if req.matcher is not None and not req.matcher.accept_token(first_token):
            log.warning("%s: the grammar refused the prefill side's token %d; finishing", req.request_id,
                        first_token)
            req.grammar_failed = True
        self._book(req, [first_token], logprob)

    def fall_back(self, req: Request) -> None:
        """The hand-off of ``req`` failed: give its reserved pages back (nothing of them is cached) and
        queue it as a plain request, to be prefilled here."""
        del self.receiving[req.request_id]
        req.num_computed_tokens = 0
        self.pages.release(req)
        self.add(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft = []
        self.pages.release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.insert(0, req)
        log.info("preempted %s (recompute later)", req.request_id)

    # the step
    def _order_waiting(self) -> list[Request]:
        if self.policy == "lpm" and len(self.waiting) > 1:
            hit = {id(r): self.pages.cached_prefix_len(r) for r in self.waiting}   # pure: LRU untouched
            return sorted(self.waiting, key=lambda r: (r.priority, -hit[id(r)], r.timings.arrival))
        return sorted(self.waiting, key=lambda r: (r.priority, r.timings.arrival))

    def _waits_for_shared_prefix(self, req: Request, cached_pages: int) -> bool:
        """True if a running prefill is about to cache a longer prefix of this prompt."""
        if not self.pages.cache.enabled:
            return False
        first = (cached_pages + 1) * self.page
        if first >= len(req.prompt_ids):
            return False
        head = req.prompt_ids[:first]
        return any(r.num_computed_tokens < len(r.prompt_ids) and r.prompt_ids[:first] == head
                   for r in self.running)

    def schedule(self, busy: frozenset[str] = frozenset(), max_requests: int | None = None) -> SchedulerOutput:
        """One step's work. Under pipeline parallelism one micro-batch's: ``busy`` names the requests
        of micro-batches still in flight (neither scheduled again nor preempted until they land) and
        ``max_requests`` caps the micro-batch, so that the running requests spread over the stages."""
        out = SchedulerOutput()
        budget, room = self.budget, max_requests if max_requests is not None else len(self.running) + len(self.waiting)
        self.running.sort(key=lambda r: (r.priority, r.timings.arrival))
        drafts = self._plan_drafts(budget)
        i = 0
        while i < len(self.running) and budget > 0 and room > 0:
            req = self.running[i]
            if req.request_id in busy:
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = self._draft(req, n, budget, drafts)
            fits = self._make_room(req, self.pages.pages_for(req.num_computed_tokens + n + len(draft)) - len(req.pages),
                                   out, busy)
            if fits:
                req.draft, n = draft, n + len(draft)
                out.scheduled.append((req, n))
                budget -= n
                room -= 1
            if fits or (fits is None and req in self.running):
                i += 1
        if not out.preempted:
            self._admit(out, budget, room)
        out.scheduled.sort(key=lambda rn: rn[1] != 1 and not rn[0].draft)   # decode rows first, stable otherwise
        out.num_prompt_tokens = sum(max(0, min(n, len(r.prompt_ids) - r.num_computed_tokens))
                                    for r, n in out.scheduled)
        return out

    def _plan_drafts(self, budget: int) -> dict[str, list[int]]:
        """The proposer's drafts for the running requests that decode this step, sized for the batch.
        None while prompts wait or prefill: such a step is bound by the prefill's compute, and a draft
        token would take a prompt token's place in the budget."""
        if self.proposer is None or (self.waiting and len(self.running) < self.max_running) or \
                any(r.num_computed_tokens < len(r.prompt_ids) for r in self.running):
            return {}
        return self.proposer.plan([(r, min(budget - 1, self.max_model_len - r.num_tokens)) for r in self.running
                                   if r.num_computed_tokens == r.num_tokens - 1])

    def _draft(self, req: Request, n: int, budget: int, drafts: dict[str, list[int]]) -> list[int]:
        """A decoding request's draft, inside what is left of the budget and the context; [] when none."""
        if n != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return []
        return drafts.get(req.request_id, [])[:max(0, min(budget - 1, self.max_model_len - req.num_tokens))]

    def _make_room(self, req: Request, need: int, out: SchedulerOutput, busy: frozenset[str] = frozenset()) -> bool | None:
        """Give running ``req`` ``need`` more pages, preempting from the back of the queue (never a
        request in flight) while they do not fit. False if ``req`` itself was preempted or cannot fit
        at all; None if it must wait for requests in flight to land."""
        while need > 0 and not self.pages.can_allocate(need):
            idle = [r for r in self.running if r.request_id not in busy]
            victim = idle[-1]
            if victim is req and len(idle) == 1:
                if len(self.running) > 1:    # the others are in flight: their pages may come back
                    return None
                self.running.remove(req)
                out.unservable.append(req)
                return False
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        if need > 0:
            self.pages.extend(req, need + self._ahead(req, need))
        return True

    def _ahead(self, req: Request, need: int) -> int:
        """Pages a decoding ``req`` takes beyond ``need`` so that its pages come RUN_PAGES at a time,
        one run of ids where the pool allows (PageAllocator): up to what its max_tokens can use, and
        only while every running request could take a run from the free pages. Prefill chunks are runs
        already; a rejected draft's pages are given back by ``trim`` as before."""
        if req.num_computed_tokens < len(req.prompt_ids) or need >= RUN_PAGES:
            return 0
        last = min(self.max_model_len, len(req.prompt_ids) + req.params.max_tokens)
        ahead = min(RUN_PAGES - need, self.pages.pages_for(last) - len(req.pages) - need)
        if ahead <= 0 or self.pages.num_free < need + ahead + RUN_PAGES * len(self.running):
            return 0
        return ahead

    def _admit(self, out: SchedulerOutput, budget: int, room: int) -> None:
        for req in self._order_waiting():
            if budget <= 0 or len(self.running) >= self.max_running or room <= 0:
                return
            if self._waits_for_shared_prefix(req, self.pages.cached_prefix_len(req) // self.page):
                continue
            cached = self.pages.acquire_prefix(req)
            n = min(req.num_tokens - cached, budget)
            need = self.pages.pages_for(cached + n) - len(req.pages)
            if not self.pages.can_allocate(need):
                self.pages.release(req)      # nothing computed yet: just gives the prefix back
                return
            self.pages.extend(req, need)
            req.num_computed_tokens = cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
                out.prompt_tokens_queried += len(req.prompt_ids)
                out.prompt_tokens_cached += cached
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
            room -= 1

    # after the step
    def update(self, out: SchedulerOutput, sampled: list[Request], tokens: list[int | list[int]],
               logprobs: list[TokenLogprob | None]) -> list[Request]:
        """Book a step's results: advance progress, append each sampled token, check stops,
        finish what ended, cache prefill progress. Returns the requests with news
        (the unservable ones, finished with 'length', then those that got a token).
        A speculating request's entry in ``tokens`` is the list of tokens its verify step kept."""
        now = time.monotonic()
        for req in out.unservable:
            log.warning("%s needs more KV pages than the whole pool; finishing with 'length'", req.request_id)
            req.finish_reason = "length"
            self.finish(req)
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = now
        for req, tok, lp in zip(sampled, tokens, logprobs, strict=True):
            if req.timings.first_token is None:
                req.timings.first_token = now
            self._book(req, tok if isinstance(tok, list) else [tok], lp)
        for req, _ in out.scheduled:
            if not req.finished and req.num_computed_tokens <= len(req.prompt_ids):
                self.pages.cache_progress(req)
        return out.unservable + sampled

    def _book(self, req: Request, kept: list[int], lp: TokenLogprob | None) -> None:
        """Append a request's new tokens up to the first stop; after a verify step, set its progress
        to the tokens whose K/V is right and give back the pages of the rejected drafts."""
        for tok in kept:
            req.output_ids.append(tok)
            if lp is not None:
                req.logprobs.append(lp)
            check_stop(req, tok, self.eos_ids, self.max_model_len)
            if req.finish_reason is not None:
                break
        if req.draft:
            req.draft = []
            req.num_computed_tokens = req.num_tokens - 1     # the last kept token is computed next step
            if req.finish_reason is None:
                self.pages.trim(req)
        if req.finish_reason is not None:
            self.finish(req)
