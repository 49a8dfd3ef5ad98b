"""Speculative decoding without a draft model: ``--speculative-algorithm NGRAM`` or ``SUFFIX``.

A decoding request whose last tokens occurred before gets the tokens that followed that occurrence
as a draft (engine/spec_lookup.py): NGRAM looks in the request's own prompt and output, SUFFIX also
in the outputs of the model's recent finished requests (SuffixDecoding's idea: agent loops and
repeated tool calls answer alike). How many draft tokens each request verifies is decided for the
whole batch from the requests' acceptance so far and the measured cost of a step's rows
(engine/spec_policy.py): as many as raise the expected tokens per second, none where they would not.

The scheduler gives a request ``1 + len(draft)`` tokens in the step (its last token, then the
draft). The runner sends each of them as a decode row over the request's pages, row j attending to
the first ``c + j + 1`` tokens (the attention op writes every row's K/V before it attends), so a
verify step is a decode step of more rows: it takes the compiled decode path when its rows fit a
bucket. ``verify`` keeps the longest draft prefix the model agrees with plus one token of the
model's own, so every step emits at least one token. The scheduler then sets the request's progress
to what was kept and the page manager releases the pages that only the rejected drafts used.

Greedy requests keep a draft token when it is the argmax, so the output is the one decoding without
speculation gives. Sampled requests use rejection sampling with the draft as a point mass q: draft
token d is kept with probability p(d); when it is refused the token comes from p with d removed,
renormalised (the residual max(p - q, 0)), so every emitted token has exactly the distribution p
of the sampler (Leviathan et al. 2023, with a deterministic draft). Seeded requests stay
reproducible: they draft from their own tokens only, K at a time, whatever the timings; their random
stream differs from a run without speculation.

What the drafts cannot reproduce token by token is left out of speculation: penalties (they depend
on the output so far), grammars, logprobs, and the stop suppression before ``min_tokens``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from polychip.engine.request import Request
from polychip.engine.sampler import _filter, apply_logit_bias
from polychip.engine.spec_lookup import NO_MATCH, NgramIndex, RecentOutputs
from polychip.engine.spec_policy import OWN_DECAY, Acceptance, StepCost, allocate

#: verify steps a request's acceptance is judged over before speculation may be switched off
ACCEPTANCE_WINDOW = 8
#: finished requests whose outputs SUFFIX drafts from
SUFFIX_RECENT_REQUESTS = 64


@dataclass(frozen=True)
class NgramSettings:
    num_draft_tokens: int
    min_window: int
    max_window: int
    min_acceptance: float
    recent_requests: int = 0          # outputs of finished requests looked up too (SUFFIX)

    @classmethod
    def of(cls, config) -> "NgramSettings":
        recent = SUFFIX_RECENT_REQUESTS if config.speculative_algorithm == "SUFFIX" else 0
        return cls(config.speculative_num_draft_tokens, config.speculative_ngram_min_match_window_size,
                   config.speculative_ngram_max_match_window_size, config.speculative_ngram_min_acceptance,
                   recent)


@dataclass
class SpecState:
    """One request's n-gram index and acceptance record."""

    index: NgramIndex | None = None
    enabled: bool = True
    recent: deque = field(default_factory=lambda: deque(maxlen=ACCEPTANCE_WINDOW))   # (proposed, accepted)
    kept: float = 0.0                    # draft tokens accepted (fading: spec_policy.OWN_DECAY a step)
    refused: float = 0.0                 # verify steps that ended on a refused draft token (fading too)
    match: int = 0                       # length of the match the current draft came from


def speculable(req: Request) -> bool:
    """True if drafts can reproduce this request's sampling token by token (see the module docstring)."""
    p = req.params
    return not (p.has_penalties or p.grammar is not None or p.logprobs is not None)


class NgramProposer:
    """Looks drafts up, sizes them for the batch, and keeps the acceptance figures."""

    def __init__(self, settings: NgramSettings, cost: StepCost | None = None, max_rows: int | None = None):
        """``max_rows``: the most rows a step's drafts may bring it to (the compiled decode path's largest
        bucket: past it a step runs eager, and on the cpu the kernels change with the row count)."""
        self.s = settings
        self.cost = cost                 # None: every draft is verified at its full length
        self.max_rows = max_rows
        self.acceptance = Acceptance(settings.max_window)
        self.recent = RecentOutputs(settings.recent_requests, settings.min_window, settings.max_window)
        self.switched_off = 0            # requests whose acceptance turned speculation off

    def _index(self, req: Request, st: SpecState) -> NgramIndex:
        if st.index is None:
            st.index = NgramIndex(self.s.min_window, self.s.max_window)
        end = req.num_tokens
        if end > st.index.indexed:
            lo = max(0, st.index.indexed - self.s.max_window)
            st.index.extend(req.tokens(lo, end), lo, end)
        return st.index

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to ``min(limit, K)`` draft tokens for ``req`` (its last token not yet computed): the longest
        match in its own tokens or, no shorter, in the recent outputs (seeded requests: their own only).
        Notes the match's length in ``req.spec.match``."""
        st = req.spec
        if st is None or not st.enabled or limit <= 0 or len(req.output_ids) < req.params.min_tokens:
            return []
        limit = min(limit, self.s.num_draft_tokens,
                    req.params.max_tokens - len(req.output_ids) - 1)   # the step's own token is the last allowed
        if limit <= 0:
            return []
        n = req.num_tokens
        tail = req.tokens(max(0, n - self.s.max_window), n)
        w, e = self._index(req, st).longest(tail)
        other = self.recent.lookup(tail, limit) if len(self.recent) and req.params.seed is None else NO_MATCH
        if other.length > w:
            st.match = other.length
            return other.tokens
        st.match = w
        if not w:
            return []
        draft = req.tokens(e, min(e + limit, n))
        while len(draft) < limit:     # a match close to the end: the repeat goes on (a period of n - e tokens)
            draft.append(draft[len(draft) - (n - e)])
        return draft

    def plan(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts for the step's decoding requests (request, limit), sized for the whole batch."""
        drafts = {r.request_id: d for r, limit in wanted if (d := self.propose(r, limit))}
        if self.cost is None or not drafts:
            return drafts
        sized = [r for r, _ in wanted if r.request_id in drafts and r.params.seed is None]
        for r in sized:
            r.spec.kept *= OWN_DECAY
            r.spec.refused *= OWN_DECAY
        counts = allocate([(len(drafts[r.request_id]),
                            self.acceptance.estimate(r.spec.kept, r.spec.refused, r.spec.match)) for r in sized],
                          len(wanted), self.cost, self.max_rows)
        for r, k in zip(sized, counts):
            if k:
                drafts[r.request_id] = drafts[r.request_id][:k]
            else:
                del drafts[r.request_id]
        return drafts

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """Book one verify step; switch the request off when its recent acceptance is low."""
        st = req.spec
        refused = int(accepted < proposed)
        st.kept += accepted
        st.refused += refused
        self.acceptance.record(st.match, accepted, refused)
        st.recent.append((proposed, accepted))
        if len(st.recent) == ACCEPTANCE_WINDOW:
            prop = sum(p for p, _ in st.recent)
            if sum(a for _, a in st.recent) < self.s.min_acceptance * prop:
                st.enabled = False
                self.switched_off += 1

    def finished(self, req: Request) -> None:
        """Remember a finished request's output for later requests' drafts (SUFFIX)."""
        if self.s.recent_requests and req.output_ids and req.finish_reason != "abort":
            self.recent.add(req.output_ids)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds`` (the cost model learns from it)."""
        if self.cost is not None:
            self.cost.observe(rows, seconds)


def verify(logits: torch.Tensor, req: Request, draft: list[int], generator: torch.Generator) -> list[int]:
    """The tokens ``req`` keeps from a verify step: the accepted draft prefix, then one token of the
    model's own. ``logits``: [len(draft) + 1, vocab] float32, row j predicting the token after draft[:j]."""
    if req.params.logit_bias:
        logits = logits.clone()
        apply_logit_bias(logits, [req] * len(logits))
    if req.params.greedy:
        best = logits.argmax(-1).tolist()
        kept = 0
        while kept < len(draft) and draft[kept] == best[kept]:
            kept += 1
        return draft[:kept] + [best[kept]]
    gen = req.generator or generator
    probs = _filter(logits, [req] * len(logits))
    d = torch.tensor(draft, device=probs.device)
    p_draft = probs[:-1].gather(1, d[:, None]).squeeze(1)
    u = torch.rand(len(draft), generator=gen, device=probs.device)
    refused = (u >= p_draft).tolist()
    kept = refused.index(True) if True in refused else len(draft)
    row = probs[kept]
    if kept < len(draft):                # the residual: p without the refused draft token
        row = row.clone()
        row[draft[kept]] = 0
    token = int(torch.multinomial(row, 1, generator=gen))
    return draft[:kept] + [token]
