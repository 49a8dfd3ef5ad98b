"""Which of the replicas that can take a request now gets it.

``choose`` (``pick``, for the policies that read more of the request than its prompt) may be called for
requests that end up not being placed, so it keeps no state that matters; ``placed`` is told the final
choice. A replica whose device runs hot (``Worker.weight``) counts as more loaded under least_load and
prefix_aware, and as slower under fastest; round_robin takes turns regardless.
"""
from __future__ import annotations

import abc

from polychip.router.fleet.worker import Worker
from polychip.router.routing.prefix_tree import PrefixTree
from polychip.router.settings import PrefixConfig


def weighted_load(r: Worker) -> float:
    """least_load's figure, raised for a replica with a lowered weight (1/weight times the load of one more)."""
    return (r.load() + 1.0) / r.weight()[0] - 1.0


class Policy(abc.ABC):
    name = ""
    uses_targets = False         # does it place by latency targets (and may leave a request waiting)?

    @abc.abstractmethod
    def choose(self, candidates: list[Worker], prompt: str) -> Worker: ...

    def pick(self, candidates: list[Worker], ticket, peers: list[Worker]) -> Worker | None:
        """The replica for ``ticket`` (dispatch.Ticket) among ``candidates`` (``peers``: every worker of its
        model); None: none may take it now."""
        return self.choose(candidates, ticket.prompt)

    def placed(self, replica: Worker, prompt: str) -> None:
        """The request went to ``replica``."""

    def forget(self, replica: Worker) -> None:
        """``replica`` left the set."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._turn = 0

    def choose(self, candidates, prompt):
        ordered = sorted(candidates, key=lambda r: r.name)
        return ordered[self._turn % len(ordered)]

    def placed(self, replica, prompt):
        self._turn += 1


class LeastLoad(Policy):
    """Waiting + running + KV usage as the replica last reported, plus our in-flight count;
    ties go round the replicas in turn."""

    name = "least_load"

    def __init__(self):
        self._rr = RoundRobin()

    def choose(self, candidates, prompt):
        loads = {r.name: weighted_load(r) for r in candidates}
        low = min(loads.values())
        tied = [r for r in candidates if loads[r.name] - low < 1e-9]
        return self._rr.choose(tied, prompt)

    def placed(self, replica, prompt):
        self._rr.placed(replica, prompt)


class PrefixAware(Policy):
    """As SGLang's cache-aware router: while the load is balanced, go where the longest prefix
    of the prompt probably sits (or, below the match threshold, to the replica holding the least
    text); when it is not, go to the least loaded."""

    name = "prefix_aware"

    def __init__(self, cfg: PrefixConfig):
        self.cfg = cfg
        self.tree = PrefixTree()
        self.least = LeastLoad()

    def _balanced(self, candidates) -> bool:
        loads = [weighted_load(r) for r in candidates]
        hi, lo = max(loads), min(loads)
        return not (hi - lo > self.cfg.balance_abs and hi > lo * self.cfg.balance_rel)

    def choose(self, candidates, prompt):
        if len(candidates) == 1:
            return candidates[0]
        if not self._balanced(candidates):
            return self.least.choose(candidates, prompt)
        text = prompt[:self.cfg.prompt_chars]
        matched = self.tree.match(text)
        by_name = {r.name: r for r in candidates}
        hits = [(n, by_name[t]) for t, n in matched.items() if t in by_name]
        if text and hits:
            best_len = max(n for n, _ in hits)
            if best_len / len(text) >= self.cfg.match_threshold:
                best = [r for n, r in hits if n == best_len]
                return min(best, key=lambda r: (weighted_load(r), r.name))
        return min(candidates, key=lambda r: (self.tree.chars.get(r.name, 0), weighted_load(r), r.name))

    def placed(self, replica, prompt):
        self.least.placed(replica, prompt)
        text = prompt[:self.cfg.prompt_chars]
        if text:
            self.tree.insert(text, replica.name)
            self.tree.evict(replica.name, self.cfg.max_chars_per_replica)

    def forget(self, replica):
        self.tree.remove_tenant(replica.name)
