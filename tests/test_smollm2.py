"""End to end on the real embedded SmolLM2-135M-Instruct (GGUF weights, tokenizer, chat template)."""
from __future__ import annotations

import pytest

from polychip import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(test_device):
    return LLM(device=test_device, max_total_tokens=8192)


def test_answers_paris_through_chat_template(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.ttft is not None and out.ttft > 0 and out.tpot is not None and out.tpot > 0
    llm.engine.check_integrity()


def test_seed_repeats_and_differs(llm):
    sp = lambda seed: SamplingParams(temperature=1.0, max_tokens=20, seed=seed, ignore_eos=True)  # noqa: E731
    a1, a2, b = (llm.chat(QUESTION, sp(s))[0].token_ids for s in (1, 1, 2))
    assert a1 == a2
    assert a1 != b


def test_top_k_one_equals_greedy(llm):
    greedy = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12))[0]
    topk1 = llm.chat(QUESTION, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, seed=3))[0]
    assert greedy.token_ids == topk1.token_ids


def test_n_returns_n_completions(llm):
    out = llm.chat(QUESTION, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_logprobs_with_top_alternatives(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=5, logprobs=4))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, lps):
        assert len(lp.top) == 4
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True) and all(v <= 0 for v in vals)
        assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-6   # greedy = best


def test_stop_string_is_cut_and_never_streamed(llm):
    e = llm.engine
    prompt = llm.apply_chat_template(QUESTION)
    rid = e.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[" Paris"]))
    deltas, final = [], None
    while e.has_unfinished():
        for o in e.step():
            if o.request_id == rid:
                deltas.append(o.outputs[0].delta_text)
                final = o
    assert final.finish_reason == "stop" and final.outputs[0].stop_reason == " Paris"
    assert "Paris" not in final.text and final.text.strip()
    assert "".join(deltas) == final.text


def test_stop_token_ids_and_max_tokens(llm):
    greedy = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=10))[0]
    third = greedy.token_ids[2]
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[third]))[0]
    assert out.token_ids == greedy.token_ids[:3] and out.finish_reason == "stop"
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=2))[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_chinese_streaming_detokenisation_equals_full_decode(llm):
    tok = llm.tokenizer
    from polychip.models.tokenizer import IncrementalDetokenizer
    text = "北京是中国的首都，上海是最大的城市。🙂 混合 text 和中文。"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2        # multi-byte characters span several tokens
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [d.add(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
