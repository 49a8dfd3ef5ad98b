"""How many draft tokens a step verifies: as many as raise the expected tokens per second.

A decode step of R rows (one per decoding request, plus one per draft token) costs ``StepCost(R)``
seconds: seeded from the compiled decode buckets' own timings at start-up, then corrected by the
steps the engine actually runs (context lengths and neighbours move it). A request whose drafts
were accepted with per-token probability p gains p^j expected tokens from its j-th draft token
(a geometric model: the j-th is kept only if the ones before it were). ``allocate`` hands out draft
tokens in order of that gain, across the whole batch, and keeps the count m that maximises

    (B + sum of the m best gains) / StepCost(B + m)

for B decoding requests, and none unless that beats the plain step by ``MIN_GAIN``. Where the step
is memory-bound (one stream: R rows cost about one) drafts are nearly free; where it is
compute-bound (16 long streams) a row costs about its share, and only drafts that are almost
surely kept pay. So speculation is never the slower choice by the model's own figures.
"""
from __future__ import annotations

#: a plan with drafts must beat the plain step's expected tokens per second by this factor
MIN_GAIN = 1.03
#: pseudo-counts of the prior in a request's acceptance estimate
PRIOR_WEIGHT = 2.0
#: how the prior's totals fade with every verify step of its match length
PRIOR_DECAY = 0.98
#: how a request's own counts fade with every step it decodes
OWN_DECAY = 0.9
#: how fast an observed step time replaces the estimate
COST_ALPHA = 0.2
#: acceptance assumed for drafts from a match length no verify step has tried yet: where a verify row costs
#: more than it gains at the prior's 0.5 (int8 weights on AVX2: 2 rows cost 1.6x one), nothing would ever be
#: tried and the prior would never learn; one verify step of each length pays for finding out
EXPLORE_ACCEPTANCE = 0.9


class StepCost:
    """Seconds of a decode step by its row count."""

    def __init__(self, seeds: dict[int, float] | None = None):
        self.seeds = dict(seeds or {})
        for r in sorted(self.seeds, reverse=True)[1:]:   # fewer rows never cost more: a burst's spike goes
            self.seeds[r] = min(self.seeds[r], min(v for k, v in self.seeds.items() if k > r))
        self.scale: dict[int, float] = {}       # observed / seed, per row count
        self.overall = 1.0                      # the same over every observation

    def seed(self, rows: int) -> float:
        """The start-up figure: a bucket's timing, or the nearest one scaled by rows beyond the largest."""
        if not self.seeds:
            return 1.0 + 0.02 * (rows - 1)      # no timings (no compiled path): rows cost little
        if rows in self.seeds:
            return self.seeds[rows]
        below = [r for r in self.seeds if r < rows]
        if not below:
            return self.seeds[min(self.seeds)]
        r = max(below)
        above = [s for s in self.seeds if s > rows]
        if above:   # between two timed sizes: interpolate
            s = min(above)
            return self.seeds[r] + (self.seeds[s] - self.seeds[r]) * (rows - r) / (s - r)
        return self.seeds[r] * rows / r          # past the largest: proportional (eager steps, more rows)

    def __call__(self, rows: int) -> float:
        return self.seed(rows) * self.scale.get(rows, self.overall)

    def observe(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` decode rows took ``seconds``."""
        ratio = seconds / self.seed(rows)
        self.scale[rows] = (1 - COST_ALPHA) * self.scale.get(rows, self.overall) + COST_ALPHA * ratio
        self.overall = (1 - COST_ALPHA) * self.overall + COST_ALPHA * ratio


class Acceptance:
    """Per-token acceptance of drafts. The prior is what drafts from a match of the same length were
    worth lately, over all requests (a long match is a repeat in progress, a 1-token one a guess); a
    request's own counts, which fade with every step it decodes, move its estimate from there. So a
    request whose first drafts failed gets drafts again once its text starts to repeat. A length not
    tried yet is estimated at EXPLORE_ACCEPTANCE until its first verify step is recorded."""

    def __init__(self, max_window: int):
        self.kept = [1.0] * (max_window + 1)       # decayed totals per match length: the priors
        self.refused = [1.0] * (max_window + 1)
        self.tried = [False] * (max_window + 1)    # a verify step of that match length was recorded

    def prior(self, match: int) -> float:
        return self.kept[match] / (self.kept[match] + self.refused[match])

    def estimate(self, kept: float, refused: float, match: int) -> float:
        """p for a draft from a ``match``-token match, for a request with (faded) ``kept`` draft tokens
        accepted and ``refused`` verify steps that ended in a refusal."""
        p = (kept + PRIOR_WEIGHT * self.prior(match)) / (kept + refused + PRIOR_WEIGHT)
        if not self.tried[match]:
            p = max(p, EXPLORE_ACCEPTANCE)
        return min(p, 0.98)

    def record(self, match: int, kept: int, refused: int) -> None:
        self.kept[match] = PRIOR_DECAY * self.kept[match] + kept
        self.refused[match] = PRIOR_DECAY * self.refused[match] + refused
        self.tried[match] = True


def allocate(candidates: list[tuple[int, float]], base_rows: int, cost: StepCost, max_rows: int | None = None) \
        -> list[int]:
    """Draft tokens to verify for each candidate (max tokens, acceptance p), given ``base_rows`` decoding
    requests in the step, with at most ``max_rows`` rows in all; the batch's best expected tokens per
    second (module docstring)."""
    gains = sorted(((p ** j, i) for i, (n, p) in enumerate(candidates) for j in range(1, n + 1)), reverse=True)
    if max_rows is not None:
        gains = gains[:max(0, max_rows - base_rows)]
    plain = base_rows / cost(base_rows)
    best, best_m, tokens = plain * MIN_GAIN, 0, float(base_rows)
    for m, (gain, _) in enumerate(gains, 1):
        tokens += gain
        rate = tokens / cost(base_rows + m)
        if rate > best:
            best, best_m = rate, m
    counts = [0] * len(candidates)
    for _, i in gains[:best_m]:
        counts[i] += 1
    return counts
