"""Speculation on the fast path: verify steps as decode rows through the compiled buckets, drafts
from recent requests' outputs (SUFFIX), and draft lengths sized by the step's cost and the acceptance."""
from __future__ import annotations

import pytest

from polychip import LLM, SamplingParams
from polychip.devices.cpu.plugin import CpuPlugin
from polychip.engine.request import Request
from polychip.engine.spec_decode import NgramProposer, NgramSettings, SpecState
from polychip.engine.spec_lookup import RecentOutputs
from polychip.engine.spec_policy import Acceptance, StepCost, allocate
from test_static_decode import RecordingPlugin, engine_on


class NoText:
    def add(self, token: int) -> str:
        return ""


def request(prompt, output=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(max_tokens=params.pop("max_tokens", 100), **params), NoText())
    r.output_ids = list(output)
    r.spec = SpecState()
    return r


@pytest.mark.device_independent
def test_drafts_go_where_rows_are_cheap_and_likely_kept():
    memory_bound = StepCost({r: 1.0 + 0.02 * r for r in range(1, 33)})     # one stream: rows nearly free
    compute_bound = StepCost({r: 8.0 + r for r in range(1, 100)})     # 16 long streams: a row costs nearly its share
    assert allocate([(8, 0.9)], 1, memory_bound) == [8]
    assert allocate([(8, 0.3)], 1, memory_bound) == [3]     # the fourth token's 0.008 does not pay its 2%
    assert allocate([(4, 0.5)] * 16, 16, compute_bound) == [0] * 16
    assert allocate([(4, 0.98)] * 16, 16, compute_bound) == [4] * 16
    # the best tokens first across the batch: the likely request gets its drafts before the unlikely
    two = StepCost({1: 1.0, 2: 1.0, 3: 1.1, 4: 1.3, 5: 1.6, 6: 2.0, 7: 2.5})
    assert allocate([(3, 0.95), (3, 0.2)], 2, two) == [2, 0]


@pytest.mark.device_independent
def test_step_cost_starts_from_the_buckets_and_learns_from_steps():
    cost = StepCost({1: 4.0, 2: 9.0, 4: 5.0, 8: 8.0})       # a burst made the 2-row timing slow
    assert cost(2) == 5.0                                   # fewer rows never cost more than more
    assert cost(6) == pytest.approx(6.5)                    # between timed sizes: interpolated
    assert cost(16) == pytest.approx(16.0)                  # past the largest: proportional
    for _ in range(30):
        cost.observe(4, 10.0)                               # long contexts: steps take twice the seed
    assert cost(4) == pytest.approx(10.0, rel=0.01)
    assert cost(8) == pytest.approx(16.0, rel=0.01)         # unseen sizes follow the overall scale
    assert StepCost()(5) > StepCost()(1)                    # no timings: rows still cost something


@pytest.mark.device_independent
def test_recent_outputs_give_the_longest_match_and_forget_the_oldest():
    recent = RecentOutputs(2, 1, 4)
    recent.add([1, 2, 3, 4, 5, 6])
    recent.add([9, 2, 3, 7, 8])
    m = recent.lookup([0, 1, 2, 3], 3)                      # "1 2 3" only in the first; "2 3" later in the second
    assert (m.length, m.tokens) == (3, [4, 5, 6])
    assert recent.lookup([5, 2, 3], 5).tokens == [7, 8]     # the latest occurrence of "2 3"
    recent.add([4, 4, 4])                                   # the first output goes
    assert recent.lookup([0, 1, 2, 3], 3).length == 2
    assert not any(doc == 0 for doc, _ in recent.ends.values())


@pytest.mark.device_independent
def test_a_repeat_in_progress_drafts_past_the_end_and_suffix_looks_in_recent_outputs():
    prop = NgramProposer(NgramSettings(6, 1, 4, 0.0, recent_requests=8))
    r = request([7, 8], output=[1, 2, 1, 2, 1])             # period 2: the draft goes on past the last token
    assert prop.propose(r, 10) == [2, 1, 2, 1, 2, 1]
    done = request([3], output=[5, 6, 7, 8, 9, 10, 11])
    done.finish_reason = "stop"
    prop.finished(done)
    fresh = request([40, 41, 5, 6], output=[7])             # its own tokens know "6" only up to here
    assert prop.propose(fresh, 3) == [8, 9, 10]
    assert fresh.spec.match == 3
    seeded = request([40, 41, 5, 6], output=[7], seed=3, temperature=0.5)
    assert prop.propose(seeded, 3) == []                    # seeded: its own tokens only (reproducible)


@pytest.mark.device_independent
def test_acceptance_starts_from_what_matches_of_that_length_were_worth():
    acc = Acceptance(12)
    for _ in range(20):
        acc.record(12, 4, 0)        # long matches were kept
        acc.record(1, 0, 1)         # 1-token matches were not
    assert acc.estimate(0, 0, 12) > 0.9 and acc.estimate(0, 0, 1) < 0.1
    assert acc.estimate(0, 3, 12) < acc.estimate(0, 0, 12)      # a request's own refusals count


@pytest.mark.device_independent
def test_a_match_length_not_tried_yet_is_tried_once_where_rows_are_dear():
    # int8 weights on a Zen 3 (AVX2): a verify row costs more than a 0.5 draft gains (the engine's seeds, ms)
    dear = StepCost({1: 5.75, 2: 9.13, 3: 10.62, 4: 11.14, 5: 15.19, 6: 16.21, 7: 17.99, 8: 19.04, 9: 23.52})
    assert allocate([(8, 0.5)], 1, dear) == [0]             # at the starting prior nothing would ever be tried
    acc = Acceptance(12)
    assert allocate([(8, acc.estimate(0, 0, 12))], 1, dear)[0] > 0      # untried: tried once
    acc.record(12, 0, 1)                                    # it was refused
    assert allocate([(8, acc.estimate(0, 0, 12))], 1, dear) == [0]      # tried: its prior decides
    assert allocate([(8, acc.estimate(0, 0, 1))], 1, dear)[0] > 0       # another length is still untried
    for _ in range(3):
        acc.record(1, 8, 0)                                 # kept: drafts go on
    assert allocate([(8, acc.estimate(0, 0, 1))], 1, dear)[0] > 0


def test_verify_steps_run_through_the_compiled_buckets(model_factory):
    path = model_factory("llama", True)
    spec = engine_on(RecordingPlugin, path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=3,
                     cuda_graph_max_bs=8)
    spec.proposer.cost = None                   # every draft at its full length: the test does not hang on timings
    plain = engine_on(CpuPlugin, path, disable_cuda_graph=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5], list(range(100, 120)) * 2]
    outs = []
    for engine in (plain, spec):
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        engine.check_integrity()
        outs.append([done[i] for i in ids])
    assert outs[0] == outs[1]
    assert spec.stats().spec_verify_steps > 0 and spec.stats().spec_accepted_tokens > 0
    verify_calls = 0   # bucket calls whose rows include one sequence at consecutive positions (a verify step)
    for entry in spec.plugin.compiled:
        for call in entry["calls"]:
            pos, pages = call["positions"][1].tolist(), call["decode_pages"][1]
            verify_calls += any(pos[i + 1] == pos[i] + 1 and bool((pages[i] == pages[i + 1]).all()) and pos[i] > 0
                                for i in range(len(pos) - 1))
    assert verify_calls > 0


@pytest.mark.device_needs("int8", "kv:bfloat16")
def test_smollm2_int8_bf16_kv_suffix_drafts_from_the_last_answer(test_device):
    """The fast configuration: int8 weights, bfloat16 KV, SUFFIX; the same agent turn twice, greedy."""
    chat = [{"role": "system", "content": 'Answer with one JSON object {"name": ..., "arguments": {...}}.'},
            {"role": "user", "content": "Call get_weather for Paris in Celsius, then say what you called."}]
    params = SamplingParams(temperature=0, max_tokens=40)
    got, stats = [], None
    for spec in (None, "SUFFIX"):
        llm = LLM(device=test_device, max_total_tokens=2048, quantization="int8", kv_cache_dtype="bfloat16",
                  speculative_algorithm=spec, speculative_num_draft_tokens=8, disable_radix_cache=True)
        if spec:
            llm.engine.proposer.cost = None
        first = llm.chat(chat, params)[0].token_ids
        before = llm.engine.stats().spec_accepted_tokens
        again = llm.chat(chat, params)[0].token_ids
        stats = llm.engine.stats()
        got.append((first, again))
        llm.engine.check_integrity()
        llm.engine.shutdown()
    assert got[0] == got[1] and got[1][0] == got[1][1]
    assert stats.spec_accepted_tokens - before > len(got[1][1]) // 2     # the second turn is mostly drafted


@pytest.mark.device_independent
def test_cpu_kernels_give_a_row_the_same_bits_at_any_batch_size():
    """A verify step's rows must equal plain decode's, bit for bit, or greedy speculation could flip a
    near-tie: the linear tiles and the decode attention may not depend on the other rows."""
    import torch
    from polychip.devices.cpu import kernels as cpu_kernels
    k = cpu_kernels.load()
    if k is None:
        pytest.skip("CPU kernels did not build here")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 576, generator=g), torch.randn(200, 576, generator=g)
    q8, scales = torch.randint(-127, 128, (200, 576), dtype=torch.int8, generator=g), torch.rand(200, generator=g)
    for m in (2, 5, 9):
        assert torch.equal(k.linear_tiles(x[:m], w, None)[0], k.linear_tiles(x[:1], w, None)[0]), m
        assert torch.equal(k.linear_int8_tiles(x[:m], q8, scales, None)[0], k.linear_int8_tiles(x[:1], q8, scales, None)[0])
    kc = torch.randn(120, 16, 3, 64, generator=g).bfloat16()
    vc = torch.randn(120, 16, 3, 64, generator=g).bfloat16()
    q = torch.randn(5, 9, 64, generator=g)
    table = torch.arange(60).repeat(5, 1)                    # one sequence of 900 tokens, five verify rows
    lens = torch.tensor([896, 897, 898, 899, 900])
    batch = k.paged_decode_attention(q, kc, vc, table, lens, 0.125, 1.0, 1.0)
    for i in range(5):
        alone = k.paged_decode_attention(q[i:i + 1], kc, vc, table[:1], lens[i:i + 1], 0.125, 1.0, 1.0)
        assert torch.equal(batch[i], alone[0]), i
