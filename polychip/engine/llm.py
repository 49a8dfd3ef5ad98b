"""The offline API: ``LLM(model_path).generate(...)`` and ``.chat(...)``."""
from __future__ import annotations

import dataclasses

from tqdm import tqdm

from polychip.config import EngineConfig
from polychip.engine.engine import Engine
from polychip.engine.request import RequestOutput
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import InvalidRequestError


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return list(prompts)


class LLM:
    def __init__(self, model_path: str | None = None, **engine_args):
        self._start(EngineConfig.from_kwargs(model_path=model_path, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        groups = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            ids = [self.engine.add_request(prompt, child, priority=(priority or [0] * len(prompts))[i])
                   for child in sp.choices()]
            groups.append((prompt, ids))
        done = {}
        bar = tqdm(total=sum(len(g) for _, g in groups), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        results = []
        for prompt, ids in groups:
            first = done[ids[0]]
            outs = []
            for j, rid in enumerate(ids):
                o = done[rid].outputs[0]
                o.index = j
                outs.append(o)
            results.append(dataclasses.replace(first, outputs=outs,
                                               prompt=prompt if isinstance(prompt, str) else None))
        return results

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             chat_template_kwargs: dict | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, **(chat_template_kwargs or {})) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        if not messages:
            raise InvalidRequestError("messages is empty")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def shutdown(self) -> None:
        self.engine.shutdown()
