"""N-gram (prompt-lookup) speculative decoding: ``--speculative-algorithm NGRAM``.

A decoding request whose last tokens occurred earlier in its own prompt or output gets the tokens
that followed that occurrence as a draft. The scheduler gives it ``1 + len(draft)`` tokens in the
step (its last token, then the draft): the runner sends them as one extend segment through paged
attention, the plugin's ordinary prefill contract, and every position is a sample row. ``verify``
keeps the longest draft prefix the model agrees with plus one token of the model's own, so every
step emits at least one token. The scheduler then sets the request's progress to what was kept and
the page manager releases the pages that only the rejected drafts used.

Greedy requests keep a draft token when it is the argmax, so the output is the one decoding without
speculation gives. Sampled requests use rejection sampling with the draft as a point mass q: draft
token d is kept with probability p(d); when it is refused the token comes from p with d removed,
renormalised (the residual max(p - q, 0)), so every emitted token has exactly the distribution p
of the sampler (Leviathan et al. 2023, with a deterministic draft). Seeded requests stay
reproducible, but their random stream differs from a run without speculation.

What the drafts cannot reproduce token by token is left out of speculation: penalties (they depend
on the output so far), grammars, logprobs, and the stop suppression before ``min_tokens``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from polychip.engine.request import Request
from polychip.engine.sampler import _filter, apply_logit_bias

#: verify steps a request's acceptance is judged over before speculation may be switched off
ACCEPTANCE_WINDOW = 8


@dataclass(frozen=True)
class NgramSettings:
    num_draft_tokens: int
    min_window: int
    max_window: int
    min_acceptance: float

    @classmethod
    def of(cls, config) -> "NgramSettings":
        return cls(config.speculative_num_draft_tokens, config.speculative_ngram_min_match_window_size,
                   config.speculative_ngram_max_match_window_size, config.speculative_ngram_min_acceptance)


@dataclass
class SpecState:
    """One request's n-gram index and acceptance record."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)   # n-gram -> end of its latest occurrence
    indexed: int = 0                     # n-grams ending before this position are indexed
    enabled: bool = True
    recent: deque = field(default_factory=lambda: deque(maxlen=ACCEPTANCE_WINDOW))   # (proposed, accepted)


def speculable(req: Request) -> bool:
    """True if drafts can reproduce this request's sampling token by token (see the module docstring)."""
    p = req.params
    return not (p.has_penalties or p.grammar is not None or p.logprobs is not None)


class NgramProposer:
    """Looks drafts up in each request's own tokens; keeps the acceptance figures."""

    def __init__(self, settings: NgramSettings):
        self.s = settings
        self.switched_off = 0            # requests whose acceptance turned speculation off

    def _index(self, req: Request, st: SpecState) -> None:
        """Index the n-grams that end before positions ``st.indexed .. num_tokens - 1`` (each has a next token)."""
        end = req.num_tokens
        if end <= st.indexed:
            return
        lo = max(0, st.indexed - self.s.max_window)
        toks = req.tokens(lo, end)
        for e in range(max(st.indexed, 1), end):
            for w in range(self.s.min_window, min(self.s.max_window, e) + 1):
                st.index[tuple(toks[e - w - lo:e - lo])] = e
        st.indexed = end

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to ``min(limit, K)`` draft tokens for ``req`` (its last token not yet computed)."""
        st = req.spec
        if st is None or not st.enabled or limit <= 0 or len(req.output_ids) < req.params.min_tokens:
            return []
        limit = min(limit, self.s.num_draft_tokens,
                    req.params.max_tokens - len(req.output_ids) - 1)   # the step's own token is the last allowed
        if limit <= 0:
            return []
        self._index(req, st)
        n = req.num_tokens
        tail = req.tokens(max(0, n - self.s.max_window), n)
        for w in range(min(self.s.max_window, len(tail)), self.s.min_window - 1, -1):
            e = st.index.get(tuple(tail[len(tail) - w:]))
            if e is not None:
                return req.tokens(e, min(e + limit, n))
        return []

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """Book one verify step; switch the request off when its recent acceptance is low."""
        st = req.spec
        st.recent.append((proposed, accepted))
        if len(st.recent) == ACCEPTANCE_WINDOW:
            prop = sum(p for p, _ in st.recent)
            if sum(a for _, a in st.recent) < self.s.min_acceptance * prop:
                st.enabled = False
                self.switched_off += 1


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
