"""N-gram speculative decoding: the draft lookup, the exactness of rejection sampling on a small
vocabulary, and the engine's output with and without speculation (tiny random model, SmolLM2)."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from polychip import LLM, SamplingParams
from polychip.engine.request import Request
from polychip.engine.spec_decode import NgramProposer, NgramSettings, SpecState, verify


class NoText:
    def add(self, token: int) -> str:
        return ""


def request(prompt, output=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(max_tokens=params.pop("max_tokens", 100), **params), NoText())
    r.output_ids = list(output)
    r.spec = SpecState()
    return r


@pytest.mark.device_independent
def test_lookup_takes_the_longest_latest_match_and_its_continuation():
    prop = NgramProposer(NgramSettings(num_draft_tokens=3, min_window=1, max_window=3, min_acceptance=0.0))
    r = request([5, 1, 2, 9, 9, 1, 2, 3, 4, 7, 8], output=[1, 2])
    # "8 1 2" only ends here; "1 2" also ends before positions 3 and 7: the latest is followed by 3 4 7
    assert prop.propose(r, 10) == [3, 4, 7]
    assert prop.propose(r, 2) == [3, 4]                 # the scheduler's limit (budget, context)
    r.output_ids.append(6)                              # "6" never occurred: no draft
    assert prop.propose(r, 10) == []
    r.output_ids += [1, 2, 3]                           # the index grows with the output: "1 2 3" occurred before position 8
    assert prop.propose(r, 10) == [4, 7, 8]
    short = request([1, 2, 3, 1, 2], max_tokens=2, output=[3])
    assert prop.propose(short, 10) == []                # one token left: the step's own
    off = request([1, 2, 1])
    off.spec.enabled = False
    assert prop.propose(off, 10) == []


@pytest.mark.device_independent
def test_low_acceptance_switches_a_request_off():
    prop = NgramProposer(NgramSettings(4, 1, 3, min_acceptance=0.5))
    r = request([1, 2, 1, 2])
    for _ in range(7):
        prop.record(r, 4, 1)
    assert r.spec.enabled                               # judged only over a full window
    prop.record(r, 4, 1)
    assert not r.spec.enabled and prop.switched_off == 1
    good = request([1, 2, 1, 2])
    for _ in range(20):
        prop.record(good, 4, 3)
    assert good.spec.enabled


@pytest.mark.device_independent
def test_greedy_verify_keeps_the_agreeing_prefix_and_the_models_token():
    logits = torch.full((4, 6), -5.0)
    for row, tok in enumerate([2, 4, 1, 5]):
        logits[row, tok] = 5.0
    r = request([0], temperature=0)
    gen = torch.Generator().manual_seed(0)
    assert verify(logits, r, [2, 4, 1], gen) == [2, 4, 1, 5]     # all kept, plus the bonus token
    assert verify(logits, r, [2, 3, 1], gen) == [2, 4]           # refused at the second draft
    assert verify(logits, r, [0, 4, 1], gen) == [2]


# exactness of rejection sampling: a 4-token Markov chain stands in for the model

VOCAB, LENGTH, TRIALS = 4, 3, 6000


def chain_logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=g) * 1.5      # row: the previous token


def speculative_run(trans: torch.Tensor, draft_of, gen, verifier) -> tuple[int, ...]:
    """Generate LENGTH tokens after token 0, each step drafting with ``draft_of`` and keeping what
    ``verifier`` keeps, as the engine does."""
    r = request([0], temperature=1.0)
    seq = [0]
    while len(seq) <= LENGTH:
        draft = draft_of(seq)
        rows = trans[[seq[-1]] + draft]               # row j: the distribution after draft[:j]
        seq += verifier(rows, r, draft, gen)
    return tuple(seq[1:LENGTH + 1])


def exact_distribution(trans: torch.Tensor) -> dict[tuple[int, ...], float]:
    p = trans.softmax(-1)
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        prob, prev = 1.0, 0
        for t in seq:
            prob, prev = prob * float(p[prev, t]), t
        out[seq] = prob
    return out


def max_z(counts: Counter, exact: dict) -> float:
    """The largest deviation of an outcome's count from its expectation, in binomial standard deviations."""
    return max(abs(counts[s] - TRIALS * p) / (TRIALS * p * (1 - p)) ** 0.5 for s, p in exact.items() if TRIALS * p >= 10)


def residual_ignored(logits, req, draft, gen):
    """A broken verifier: after a refusal it samples from p itself, not from the residual."""
    probs = logits.softmax(-1)
    for j, d in enumerate(draft):
        if float(torch.rand(1, generator=gen)) >= float(probs[j, d]):
            return draft[:j] + [int(torch.multinomial(probs[j], 1, generator=gen))]
    return draft + [int(torch.multinomial(probs[-1], 1, generator=gen))]


@pytest.fixture
def one_thread():
    """Thousands of tiny tensor ops: with several threads they wait on each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.device_independent
def test_rejection_sampling_keeps_the_distribution_exact(one_thread):
    trans = chain_logits()
    exact = exact_distribution(trans)
    drafts = [lambda seq: [1, 2, 3], lambda seq: [seq[-1]] * 2, lambda seq: [int(trans[seq[-1]].argmin())]]
    gen = torch.Generator().manual_seed(7)
    for draft_of in drafts:
        counts = Counter(speculative_run(trans, draft_of, gen, verify) for _ in range(TRIALS))
        assert max_z(counts, exact) < 4.5, draft_of
    # the check has the power to see a verifier that skews the distribution
    counts = Counter(speculative_run(trans, drafts[0], gen, residual_ignored) for _ in range(TRIALS))
    assert max_z(counts, exact) > 6


# the engine

PASSAGE = ("the river runs to the sea and the sea runs to the sky ; " * 6).split()


def prompts(llm) -> list[list[int]]:
    tok = llm.engine.tokenizer
    text = " ".join(PASSAGE)
    return [tok.encode(text), tok.encode("repeat : " + text + " repeat :"), tok.encode("a b c d e f g a b c")]


def run(llm, ids, params):
    return [o.token_ids for o in llm.generate(ids, params)]


@pytest.fixture(scope="module")
def tiny(model_factory, test_device):
    path = model_factory("llama", False)
    plain = LLM(path, device=test_device, max_total_tokens=4096)
    spec = LLM(path, device=test_device, max_total_tokens=4096, speculative_algorithm="NGRAM",
               speculative_num_draft_tokens=4)
    yield plain, spec
    plain.engine.shutdown()
    spec.engine.shutdown()


def test_greedy_output_is_identical_with_speculation(tiny):
    plain, spec = tiny
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ids = prompts(plain)
    base = [run(plain, [p], params)[0] for p in ids]
    got = [run(spec, [p], params)[0] for p in ids]
    s = spec.engine.stats()
    assert got == base
    assert s.spec_accepted_tokens > 0 and s.spec_verify_steps > 0
    assert s.generation_tokens == sum(map(len, got))
    spec.engine.check_integrity()
    spec.engine.flush_prefix_cache()
    assert spec.engine.stats().pages_free == spec.engine.stats().pages_total    # rejected drafts' pages came back


def test_mixed_batch_with_plain_sampled_and_stopping_requests(tiny):
    plain, spec = tiny
    ids = prompts(plain)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    stop_at = run(plain, [ids[0]], greedy)[0][17]
    mixed = [(ids[0], greedy), (ids[1], SamplingParams(temperature=0.8, max_tokens=30, seed=3, ignore_eos=True)),
             (ids[2], SamplingParams(temperature=0, max_tokens=25, repetition_penalty=1.3, ignore_eos=True)),
             (ids[1], SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True)),
             (ids[0], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at], ignore_eos=True))]
    before = spec.engine.stats().spec_verify_steps
    outs = {}
    for eng in (plain, spec):
        e = eng.engine
        rids = [e.add_request(p, sp) for p, sp in mixed]
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    outs[(eng is spec, o.request_id)] = o
        outs[eng is spec] = [outs[(eng is spec, rid)] for rid in rids]
        e.check_integrity()
    base, got = outs[False], outs[True]
    for i in (0, 2, 3, 4):                    # greedy: the same tokens, speculating or not (2, 3 do not)
        assert got[i].token_ids == base[i].token_ids, i
    assert got[4].token_ids[-1] == stop_at and got[4].finish_reason == "stop"
    assert len(got[1].token_ids) == 30 and len(got[3].outputs[0].logprobs) == 30
    assert spec.engine.stats().spec_verify_steps > before


def test_sampled_speculation_is_reproducible_with_a_seed(tiny):
    _, spec = tiny
    ids = prompts(spec)[1]
    params = SamplingParams(temperature=0.7, max_tokens=32, seed=11, ignore_eos=True)
    a, b = run(spec, [ids], params)[0], run(spec, [ids], params)[0]
    assert a == b and len(a) == 32
    spec.engine.check_integrity()


def test_smollm2_greedy_identical_with_speculation(test_device):
    passage = ("Rivers carry water from the mountains to the sea. Along their banks, farms grow wheat and "
               "barley, and towns trade what the farms grow. ") * 3
    chat = [{"role": "user", "content": "Repeat this passage exactly:\n" + passage}]
    params = SamplingParams(temperature=0, max_tokens=64)
    got = []
    for spec in (None, "NGRAM"):
        llm = LLM(device=test_device, max_total_tokens=4096, speculative_algorithm=spec)
        got.append(llm.chat(chat, params)[0].token_ids)
        stats = llm.engine.stats()
        llm.engine.check_integrity()
        llm.engine.shutdown()
    assert got[0] == got[1]
    assert stats.spec_accepted_tokens > len(got[1]) // 3      # a repeat is mostly looked up


@pytest.mark.device_independent
@pytest.mark.parametrize("kwargs, match", [
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm must be one of"),
    ({"speculative_ngram_min_match_window_size": 4, "speculative_ngram_max_match_window_size": 2}, "must be >="),
    ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens must be >= 1"),
    ({"speculative_num_draft_tokens": 512}, "below chunked_prefill_size"),
    ({"speculative_ngram_min_acceptance": 1.5}, r"in \[0, 1\]"),
    ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "cannot be used with disable_radix_cache"),
])
def test_bad_speculative_and_host_tier_settings_are_refused(kwargs, match):
    from polychip.config import EngineConfig
    from polychip.errors import ConfigError
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(**kwargs)
