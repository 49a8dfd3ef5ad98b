"""The router's speed estimates (fleet/speed.py): one stalled answer moves them a step, a real slowdown
is still learnt."""
from __future__ import annotations

import pytest

from polychip.router.fleet.speed import OUTLIER, Job, Speed

pytestmark = pytest.mark.device_independent   # runs no model (conftest.py)


def _answer(speed: Speed, tpot: float, tokens: int = 4, ttft: float = 0.02) -> None:
    job = Job(sent_at=0.0, prompt_tokens=5, max_tokens=tokens, prefill_tokens=5, batch=1, first_token_by=0.0)
    speed.answered(job, ttft, ttft + tpot * (tokens - 1), tokens, 1)


def test_one_stalled_answer_moves_the_estimate_a_step_not_tenfold():
    speed = Speed(alpha=0.1)
    for _ in range(10):
        _answer(speed, 0.01)
    _answer(speed, 0.65)                       # one answer stalled 0.64 s per token (a pause, not the replica)
    weight = 1 / sum(0.9 ** k for k in range(11))          # the newest answer's share of the moving mean
    assert speed.decode.predict(1) == pytest.approx(0.01 + weight * (OUTLIER - 1) * 0.01, rel=1e-6)
    assert speed.decode.predict(1) < 1.5 * 0.01
    _answer(speed, 0.01, ttft=3.0)             # a stalled first token, likewise
    assert speed.prefill.predict(5) < 1.5 * 0.02


def test_a_replica_that_really_slowed_down_is_learnt_within_a_few_answers():
    speed = Speed(alpha=0.3)
    for _ in range(10):
        _answer(speed, 0.01)
    for _ in range(12):
        _answer(speed, 0.08)                   # eight times slower from now on
    assert speed.decode.predict(1) == pytest.approx(0.08, rel=0.05)


def test_the_first_answers_are_taken_as_they_come():
    speed = Speed(alpha=0.5)
    _answer(speed, 0.2)
    _answer(speed, 0.01)
    assert speed.decode.predict(1) == pytest.approx((0.5 * 0.2 + 0.01) / 1.5, rel=1e-6)


def test_a_stalled_first_answer_is_capped_when_the_line_becomes_trusted():
    speed = Speed(alpha=0.1)
    _answer(speed, 1.0)                        # a fresh replica's first answer carries its warm-up
    _answer(speed, 0.01)
    assert speed.decode.predict(1) > 0.4       # not yet trusted: taken as it came
    _answer(speed, 0.01)
    assert speed.decode.predict(1) == pytest.approx((0.81 * OUTLIER * 0.01 + 0.9 * 0.01 + 0.01) / 2.71, rel=1e-6)


def test_a_slower_first_answer_explained_by_more_work_is_kept():
    speed = Speed(alpha=0.1)
    for tokens in (5, 5, 800):                 # the longer prompt takes 80 times as long: not a stall
        job = Job(sent_at=0.0, prompt_tokens=tokens, max_tokens=4, prefill_tokens=tokens, batch=1, first_token_by=0.0)
        speed.answered(job, 0.0005 * tokens, 0.0005 * tokens + 0.03, 4, 1)
    assert speed.prefill.predict(800) == pytest.approx(0.4, rel=1e-3)
