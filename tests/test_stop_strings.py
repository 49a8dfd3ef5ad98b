"""The stop-string hold-back: the same answer as the definition, at a cost that does not grow with
the output (it runs for every request at every step, on the engine thread)."""
from __future__ import annotations

import random
import time

from polychip.engine.stop import held_back


def by_definition(text: str, stops: list[str]) -> int:
    """The longest end of ``text`` that is a proper beginning of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_held_back_matches_the_definition():
    rnd = random.Random(1)
    for _ in range(20_000):
        text = "".join(rnd.choice("ab ") for _ in range(rnd.randint(0, 14)))
        stops = ["".join(rnd.choice("ab ") for _ in range(rnd.randint(1, 7))) for _ in range(rnd.randint(1, 4))]
        assert held_back(text, stops) == by_definition(text, stops), (text, stops)


def _cost(text: str, stops: list[str], reps: int = 200) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        held_back(text, stops)
    return time.perf_counter() - t0


def test_cost_does_not_grow_with_the_output():
    rnd = random.Random(2)
    stops = [" " + "".join(rnd.choice("ab") for _ in range(255)) for _ in range(16)]   # a maximal list
    short = "".join(rnd.choice("ab ") for _ in range(300))
    long = "".join(rnd.choice("ab ") for _ in range(3_000_000)) + short
    assert held_back(long, stops) == held_back(short, stops)
    ratio = min(_cost(long, stops) for _ in range(3)) / min(_cost(short, stops) for _ in range(3))
    assert ratio < 3, ratio               # a scan of the whole text would be ~10,000x
