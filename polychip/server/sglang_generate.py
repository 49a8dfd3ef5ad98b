"""SGLang's ``/generate``: its request (``GenerateReqInput`` with ``sampling_params``) and its
response shapes (``text``, ``output_ids``, ``meta_info``; cumulative text when streamed)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from polychip.engine.async_engine import SubRequest
from polychip.engine.grammar_spec import GrammarSpec
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import InvalidRequestError
from polychip.server.serving import ServerState, check_stop_limits, collect, max_tokens_for, submit
from polychip.server.streaming import sse, sse_guard

DEFAULT_MAX_NEW_TOKENS = 128        # SGLang's default


class SGLangSamplingParams(BaseModel):
    """SGLang's ``sampling_params``; an unknown key is a 400, as in SGLang."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False
    no_stop_trim: bool = False
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None
    structural_tag: str | None = None
    custom_params: dict | None = None

    def grammar_spec(self) -> GrammarSpec | None:
        specs = []
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"sampling_params.json_schema is not valid JSON: {e.msg}") from None
            specs.append(GrammarSpec.json_schema(schema, "sampling_params.json_schema"))
        if self.regex is not None:
            specs.append(GrammarSpec("regex", self.regex, param="sampling_params.regex"))
        if self.ebnf is not None:
            specs.append(GrammarSpec("ebnf", self.ebnf, param="sampling_params.ebnf"))
        if len(specs) > 1:
            raise InvalidRequestError("sampling_params: only one of json_schema, regex, ebnf may be set")
        return specs[0] if specs else None

    def to_params(self, max_tokens: int, logprobs: int | None, grammar: GrammarSpec | None) -> SamplingParams:
        for name, why in (("structural_tag", "use json_schema, regex or ebnf"), ("custom_params", "no custom "
                          "logit processors")):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"sampling_params.{name} is not supported ({why})")
        if self.stream_interval not in (None, 1):
            raise InvalidRequestError("sampling_params.stream_interval must be 1 (every token is streamed)")
        bias = None
        if self.logit_bias:
            if not all(k.strip().isdigit() for k in self.logit_bias):
                raise InvalidRequestError("sampling_params.logit_bias keys must be token ids (digits)")
            bias = {int(k): v for k, v in self.logit_bias.items()}
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                seed=self.sampling_seed, repetition_penalty=self.repetition_penalty,
                frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                max_tokens=max_tokens, min_tokens=self.min_new_tokens, stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.no_stop_trim,
                spaces_between_special_tokens=self.spaces_between_special_tokens, logit_bias=bias,
                grammar=grammar)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"sampling_params.{e.args[0]}") from None


class GenerateRequest(BaseModel):
    """SGLang's ``GenerateReqInput``: the fields served; the multimodal, LoRA and session ones are
    refused by name."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None    # SGLangSamplingParams each
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    # refused
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    session_params: Any = None
    return_hidden_states: bool = False
    custom_logit_processor: Any = None

    def check(self) -> None:
        for name in ("image_data", "audio_data", "video_data", "input_embeds", "lora_path", "session_params",
                     "custom_logit_processor"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{name} is not supported by this server")
        if self.return_hidden_states:
            raise InvalidRequestError("return_hidden_states is not supported by this server")
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("send exactly one of text and input_ids")
        if self.logprob_start_len != -1:
            raise InvalidRequestError("logprob_start_len: only -1 (output logprobs) is supported; "
                                      "there are no prompt logprobs")
        if not 0 <= self.top_logprobs_num <= 20:
            raise InvalidRequestError(f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num}")

    async def prompts(self, state: ServerState) -> tuple[list[list[int]], bool]:
        """(token ids per prompt, whether the request is a batch); texts are size-checked and
        tokenised off the event loop."""
        if self.text is not None:
            texts = [self.text] if isinstance(self.text, str) else self.text
            for t in texts:
                state.engine.check_prompt_size(t, "text")
            encode = state.tokenizer.encode
            return await state.engine.run_tokenizer(lambda: [encode(t) for t in texts]), not isinstance(self.text, str)
        ids = self.input_ids
        if ids and isinstance(ids[0], list):
            return [list(p) for p in ids], True
        return [list(ids)], False

    def params_for(self, i: int) -> SGLangSamplingParams:
        sp = self.sampling_params
        if isinstance(sp, list):
            if len(sp) <= i:
                raise InvalidRequestError(f"sampling_params has {len(sp)} entries for a batch of more prompts")
            sp = sp[i]
        try:
            return SGLangSamplingParams.model_validate(sp or {})
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise InvalidRequestError(f"sampling_params.{where}: {err.get('msg', 'invalid')}") from None


def finish_reason(out) -> dict | None:
    """SGLang's finish_reason object: stop (with what matched), length, or abort."""
    o = out.outputs[0]
    if not out.finished:
        return None
    if o.finish_reason == "length":
        return {"type": "length", "length": len(o.token_ids)}
    if o.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    matched = o.stop_reason if o.stop_reason is not None else (o.token_ids[-1] if o.token_ids else None)
    return {"type": "stop", "matched": matched}


def _logprob_entries(tokenizer, lps, with_text: bool) -> tuple[list, list]:
    def entry(tid, lp):
        return [lp, tid, tokenizer.decode([tid], skip_special_tokens=False) if with_text else None]
    chosen = [entry(x.token_id, x.logprob) for x in lps]
    top = [[entry(t, lp) for t, lp in x.top] for x in lps]
    return chosen, top


def result(out, meta_id: str, text: str, started: float, req: GenerateRequest, tokenizer) -> dict:
    o = out.outputs[0]
    meta = {"id": meta_id, "finish_reason": finish_reason(out), "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(o.token_ids), "cached_tokens": out.num_cached_tokens,
            "weight_version": "default"}
    if out.finished:
        meta["e2e_latency"] = time.monotonic() - started
    if req.return_logprob:
        chosen, top = _logprob_entries(tokenizer, o.logprobs or [], req.return_text_in_logprobs)
        meta["output_token_logprobs"] = chosen
        meta["output_top_logprobs"] = top if req.top_logprobs_num else [None] * len(chosen)
    return {"text": text, "output_ids": list(o.token_ids), "meta_info": meta}


async def generate(state: ServerState, req: GenerateRequest, request: Request) -> Response:
    req.check()
    tok = state.tokenizer
    prompts, batch = await req.prompts(state)
    if not prompts or any(not p for p in prompts):
        raise InvalidRequestError("the prompt is empty")
    rid = req.rid if isinstance(req.rid, str) else request.state.request_id
    rids = req.rid if isinstance(req.rid, list) else None
    if rids is not None and len(rids) != len(prompts):
        raise InvalidRequestError(f"rid has {len(rids)} ids for {len(prompts)} prompts")
    subs, meta_ids = [], []
    for i, ids in enumerate(prompts):
        sp = req.params_for(i)
        max_tokens = max_tokens_for(state, len(ids), sp.max_new_tokens)
        grammar = sp.grammar_spec()
        if grammar is not None:
            grammar = await asyncio.to_thread(state.grammar.compiled, grammar)
        params = sp.to_params(max_tokens, req.top_logprobs_num if req.return_logprob else None, grammar)
        check_stop_limits(state.config, params.stop, params.stop_token_ids)
        base = rids[i] if rids is not None else (rid if not batch else f"{rid}-{i}")
        for j, child in enumerate(params.choices()):
            meta_ids.append(base if params.n == 1 else f"{base}-{j}")
            subs.append(SubRequest(f"{request.state.request_id}-g{len(subs)}", ids, child))
    state.engine.check_group_size(len(subs))
    many = batch or len(subs) > 1
    started = time.monotonic()
    stream = await submit(state, subs)
    if req.stream:
        return StreamingResponse(sse_guard(_events(state, req, stream, meta_ids, many, started), stream,
                                           request.state.request_id),
                                 media_type="text/event-stream", headers={"cache-control": "no-cache"})
    finals = await collect(request, stream, len(subs))
    if finals is None:
        return Response(status_code=499)
    results = [result(out, meta_ids[i], out.outputs[0].text, started, req, tok) for i, out in enumerate(finals)]
    return JSONResponse(results if many else results[0])


async def _events(state, req, stream, meta_ids, many, started):
    texts = [""] * len(meta_ids)
    async for i, out in stream:
        texts[i] += out.outputs[0].delta_text
        body = result(out, meta_ids[i], texts[i], started, req, state.tokenizer)
        if many:
            body["index"] = i
        yield sse(body)
    yield sse("[DONE]")
