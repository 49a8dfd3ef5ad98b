"""SGLang's native worker API with SGLang's request and response shapes, so SGLang's router
(``sglang-router``) and SGLang clients can use a polychip server as a worker:

- ``POST /generate``: ``text`` or ``input_ids`` (one or a batch), ``sampling_params``, ``stream``
  (cumulative ``text`` per event, as SGLang streams), ``return_logprob``;
- ``GET /model_info`` (and the older ``/get_model_info``);
- ``GET /server_info`` (and ``/get_server_info``): the server's settings, ``internal_states`` and
  polychip's own KV-pool figures with an integrity check;
- ``GET|POST /flush_cache``: drops the prefix cache's unused pages (polychip can do it while
  requests run, so it always answers 200, with the figures as JSON);
- ``GET /health_generate``: 200 once one token has been generated, 503 otherwise.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from polychip.config import ServerConfig
from polychip.engine.async_engine import SubRequest
from polychip.engine.engine import COUNTERS
from polychip.engine.grammar import GrammarSpec
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import IntegrityError, InvalidRequestError
from polychip.server.errors import parse_body, to_response
from polychip.server.serving import ServerState, collect, resolve_max_tokens, sse, sse_guard, submit

log = logging.getLogger("polychip.server")

HEALTH_GENERATE_TIMEOUT = 20.0      # seconds, as SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
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

    def prompts(self, tokenizer) -> tuple[list[list[int]], bool]:
        """(token ids per prompt, whether the request is a batch)."""
        if self.text is not None:
            texts = [self.text] if isinstance(self.text, str) else self.text
            return [tokenizer.encode(t) for t in texts], not isinstance(self.text, str)
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
    prompts, batch = req.prompts(tok)
    if not prompts or any(not p for p in prompts):
        raise InvalidRequestError("the prompt is empty")
    rid = req.rid if isinstance(req.rid, str) else request.state.request_id
    rids = req.rid if isinstance(req.rid, list) else None
    if rids is not None and len(rids) != len(prompts):
        raise InvalidRequestError(f"rid has {len(rids)} ids for {len(prompts)} prompts")
    subs, meta_ids = [], []
    for i, ids in enumerate(prompts):
        sp = req.params_for(i)
        wanted = sp.max_new_tokens
        max_tokens = resolve_max_tokens(state, len(ids), wanted, "input")
        grammar = sp.grammar_spec()
        if grammar is not None:
            grammar = await asyncio.to_thread(state.grammar.compiled, grammar)
        params = sp.to_params(max_tokens, req.top_logprobs_num if req.return_logprob else None, grammar)
        base = rids[i] if rids is not None else (rid if not batch else f"{rid}-{i}")
        for j in range(params.n):
            child = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + j)
            meta_ids.append(base if params.n == 1 else f"{base}-{j}")
            subs.append(SubRequest(f"{request.state.request_id}-g{len(subs)}", ids, child))
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


def pool_info(engine) -> dict:
    """Runs in the engine thread: the engine's stats() plus an integrity check."""
    try:
        engine.check_integrity()
        integrity = "ok"
    except IntegrityError as e:
        integrity = f"broken: {e}"
    st = engine.stats()
    return {"kv_pool": {"num_pages": st.pages_total, "free_pages": st.pages_free, "cached_pages": st.pages_cached,
                        "page_size": st.page_size, "integrity": integrity},
            "num_waiting": st.num_waiting, "num_running": st.num_running,
            "counters": {k: getattr(st, k) for k in COUNTERS}}


def flush_cache(engine) -> dict:
    released = engine.flush_prefix_cache()
    return {"message": "Cache flushed.", "released_pages": released, **pool_info(engine)}


def model_info(state: ServerState) -> dict:
    eng = state.engine.engine
    path = eng.config.model_path or state.model_root
    hf = {}
    cfg_file = os.path.join(state.model_root, "config.json")
    if os.path.exists(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            hf = json.load(f)
    return {"model_path": path, "tokenizer_path": path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": hf.get("model_type"), "architectures": hf.get("architectures")
            or [eng.model_config.architecture]}


def server_args(state: ServerState, cfg: ServerConfig) -> dict:
    """The settings in SGLang's ``ServerArgs`` names (the API key is never shown)."""
    eng = state.engine.engine
    ec = eng.config
    return {"model_path": eng.config.model_path or state.model_root, "tokenizer_path": ec.model_path or state.model_root,
            "served_model_name": state.model_name, "host": cfg.host, "port": cfg.port, "dtype": ec.dtype,
            "context_length": ec.max_model_len, "device": eng.plugin.name, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "page_size": ec.page_size, "max_total_tokens": ec.max_total_tokens,
            "mem_fraction_static": ec.mem_fraction_static, "chunked_prefill_size": ec.chunked_prefill_size,
            "max_running_requests": ec.max_running_requests, "max_queued_requests": cfg.max_waiting_requests,
            "schedule_policy": ec.schedule_policy, "disable_radix_cache": ec.disable_radix_cache,
            "random_seed": ec.seed, "reasoning_parser": cfg.reasoning_parser, "tool_call_parser": cfg.tool_call_parser,
            "grammar_backend": "xgrammar", "skip_server_warmup": cfg.skip_server_warmup,
            "enable_metrics": cfg.enable_metrics, "log_level": cfg.log_level, "api_key": None,
            "is_embedding": False, "weight_version": "default"}


def make_router(state: ServerState, cfg: ServerConfig, version: str) -> APIRouter:
    ae = state.engine
    router = APIRouter()
    args = server_args(state, cfg)

    async def generate_route(request: Request):
        try:
            req = parse_body(await request.body(), GenerateRequest)
            return await generate(state, req, request)
        except Exception as e:
            return to_response(e)

    async def model_info_route():
        return model_info(state)

    async def server_info_route():
        try:
            info = await ae.call(pool_info)
        except Exception as e:
            return to_response(e)
        eng = ae.engine
        internal = {**args, "memory_usage": {"token_capacity": eng.pool.num_tokens},
                    "effective_max_running_requests_per_dp": eng.config.max_running_requests}
        return {**args, "status": "ready", "max_total_num_tokens": eng.pool.num_tokens,
                "max_req_input_len": state.max_model_len - 1, "internal_states": [internal], "version": version,
                # polychip's own figures
                "model": state.model_name, "max_model_len": state.max_model_len, "plugin": eng.plugin.name,
                "device_index": eng.plugin.index, **info}

    async def flush_route():
        try:
            return await ae.call(flush_cache)
        except Exception as e:
            return to_response(e)

    async def health_generate_route():
        if not ae.alive:
            return Response(status_code=503)
        sub = SubRequest(f"health-{uuid.uuid4().hex}", [0], SamplingParams(temperature=0, max_tokens=1))
        try:
            stream = await ae.submit([sub])
            await asyncio.wait_for(_drain(stream), HEALTH_GENERATE_TIMEOUT)
        except Exception as e:          # overloaded, dead, or too slow: not healthy now
            log.warning("health_generate failed: %s", type(e).__name__)
            return Response(status_code=503)
        return Response(status_code=200)

    router.add_api_route("/generate", generate_route, methods=["POST", "PUT"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info_route, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info_route, methods=["GET"])
    router.add_api_route("/flush_cache", flush_route, methods=["GET", "POST"])
    router.add_api_route("/health_generate", health_generate_route, methods=["GET"])
    return router


async def _drain(stream) -> None:
    try:
        async for _ in stream:
            pass
    finally:
        stream.close()
