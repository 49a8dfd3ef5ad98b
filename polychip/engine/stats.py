"""Per-stage step time."""
from __future__ import annotations

import contextlib
from time import perf_counter

#: the stages of ``Engine.step``, in order ("detokenize": the scheduler's update, whose
#: stop checks detokenize, and building the outputs)
STAGES = ("schedule", "prepare", "forward", "sample", "detokenize")


class StageTimer:
    """``with timer("forward"): ...`` adds the block's wall time to ``seconds["forward"]``."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += perf_counter() - start

