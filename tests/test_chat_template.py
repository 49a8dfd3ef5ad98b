"""Chat templates render as transformers renders them; Qwen3's enable_thinking passes through."""
from __future__ import annotations

import pytest

from polychip.models.tokenizer import Tokenizer
from tests.conftest import QWEN_TOKENIZER_DIR

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


@pytest.mark.parametrize("thinking", [True, False, None])
def test_qwen3_template_matches_transformers(thinking):
    import transformers
    ours = Tokenizer.from_dir(QWEN_TOKENIZER_DIR)
    ref = transformers.AutoTokenizer.from_pretrained(QWEN_TOKENIZER_DIR)
    kw = {} if thinking is None else {"enable_thinking": thinking}
    got = ours.apply_chat_template(MSGS, add_generation_prompt=True, **kw)
    want = ref.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False, **kw)
    assert got == want
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (thinking is False)
    assert ours.encode(got) == ref(got, add_special_tokens=True)["input_ids"]


def test_llm_chat_passes_enable_thinking(model_factory, test_device):
    from polychip import LLM, SamplingParams
    llm = LLM(model_factory("qwen3", False), device=test_device, max_total_tokens=512)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    off = llm.chat(MSGS[:2], sp, chat_template_kwargs={"enable_thinking": False})[0]
    on = llm.chat(MSGS[:2], sp, chat_template_kwargs={"enable_thinking": True})[0]
    tail = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert llm.tokenizer.decode(off.prompt_token_ids, skip_special_tokens=False).endswith(tail)
    assert llm.tokenizer.decode(on.prompt_token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
