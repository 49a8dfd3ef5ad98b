"""Sampler units on hand-made logits: penalties, filters, seeds, min_tokens, distribution."""
from __future__ import annotations

import math

import pytest
import torch

from polychip.devices.cpu import CpuPlugin
from polychip.engine.request import Request
from polychip.engine.sampler import Sampler, _filter, apply_penalties
from polychip.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

EOS = 9


def req(prompt=(1, 2), out=(), seed=None, **kw):
    r = Request("r", list(prompt), SamplingParams(**kw), detokenizer=None,
                generator=None if seed is None else torch.Generator().manual_seed(seed))
    r.output_ids = list(out)
    return r


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    r = req(prompt=[0, 1], out=[2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [r])
    # rep: seen {0,1,2,3}: positive / 2, negative * 2; then freq*count + presence for outputs 2 (x2), 3 (x1)
    want = torch.tensor([[1.0, -4.0, 0.5 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 0.5]])
    torch.testing.assert_close(logits, want)


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = _filter(logits.clone(), [req(temperature=1.0, top_k=2)])
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0, 0]]))
    probs = _filter(logits.clone(), [req(temperature=1.0, top_p=0.7)])   # 0.5 + 0.3 reaches 0.7
    assert (probs[0, 2:] == 0).all() and probs[0, :2].gt(0).all()
    probs = _filter(logits.clone(), [req(temperature=1.0, min_p=0.4)])   # keep p >= 0.2
    assert (probs[0] > 0).tolist() == [True, True, False, False]


def test_seeded_sampling_follows_the_distribution_and_repeats():
    sampler = Sampler(CpuPlugin(), seed=0, eos_ids=frozenset({EOS}))
    p = torch.tensor([0.6, 0.3, 0.1] + [0.0] * 7)
    logits = torch.log(p).expand(4000, -1).clone()
    reqs = [req(temperature=1.0) for _ in range(4000)]
    toks, _ = sampler(logits, reqs)
    freq = torch.bincount(torch.tensor(toks), minlength=10).float() / 4000
    assert torch.allclose(freq[:3], p[:3], atol=0.03) and freq[3:].sum() == 0
    a = sampler(logits[:50], [req(temperature=1.0, seed=i) for i in range(50)])[0]
    b = sampler(logits[:50], [req(temperature=1.0, seed=i) for i in range(50)])[0]
    assert a == b


def test_min_tokens_suppresses_eos_and_stop_ids():
    sampler = Sampler(CpuPlugin(), seed=0, eos_ids=frozenset({EOS}))
    logits = torch.zeros(2, 10)
    logits[:, EOS] = 10.0
    logits[:, 4] = 9.0
    early = req(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[4])
    late = req(out=[5, 5], temperature=0, min_tokens=2, max_tokens=5)
    toks, _ = sampler(logits, [early, late])
    assert toks[0] not in (EOS, 4) and toks[1] == EOS


def test_logprobs_are_log_softmax_of_raw_logits():
    sampler = Sampler(CpuPlugin(), seed=0, eos_ids=frozenset())
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    toks, lps = sampler(logits, [req(temperature=0, logprobs=2)])
    ref = logits.log_softmax(-1)[0]
    assert toks == [1] and math.isclose(lps[0].logprob, ref[1].item(), rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [1, 2]
