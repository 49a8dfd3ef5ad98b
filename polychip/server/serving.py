"""What chat and text completions share: server state, limits, submission, collection, logprobs, SSE."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from polychip.engine.async_engine import AsyncEngine, RequestStream, SubRequest
from polychip.engine.request import RequestOutput, TokenLogprob
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import InvalidRequestError
from polychip.server.errors import APIError, error_body, message_of, to_response

log = logging.getLogger("polychip.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    model_root: str
    max_model_len: int
    reasoning_parser: str | None = None
    metrics: object | None = None          # ServerMetrics when --enable-metrics
    chat_defaults: dict = dataclasses.field(default_factory=dict)   # server-wide chat_template_kwargs
    tool_call_parser: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def grammar(self):
        """The engine's GrammarBackend (thread-safe compile)."""
        return self.engine.engine.grammar

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()


def resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None, what: str) -> int:
    """The request's max_tokens, checked against the context; None means 'the rest of the context'."""
    ctx = state.max_model_len
    if prompt_len >= ctx:
        raise InvalidRequestError(f"{what} has {prompt_len} tokens; the model's context is {ctx} tokens and "
                                  "at least one must be left to generate")
    if requested is None:
        return ctx - prompt_len
    if requested < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {requested}")
    if prompt_len + requested > ctx:
        raise InvalidRequestError(
            f"max_tokens is too large: this model's maximum context length is {ctx} tokens, but you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the completion)")
    return requested


def check_stop_token_ids(state: ServerState, ids: list[int] | None) -> None:
    vocab = state.engine.engine.model_config.vocab_size
    bad = [i for i in ids or [] if not 0 <= i < vocab]
    if bad:
        raise InvalidRequestError(f"stop_token_ids has ids outside [0, {vocab}): {bad[:5]}")


def sub_requests(request_id: str, prompts: list[list[int]], params: SamplingParams, priority: int
                 ) -> list[SubRequest]:
    """n choices per prompt as n engine requests (seeds seed + j, as ``LLM.generate`` does)."""
    subs = []
    for i, ids in enumerate(prompts):
        for j in range(params.n):
            child = dataclasses.replace(copy.copy(params), n=1,
                                        seed=None if params.seed is None else params.seed + j)
            subs.append(SubRequest(f"{request_id}-{i * params.n + j}", ids, child, priority))
    return subs


async def submit(state: ServerState, subs: list[SubRequest]) -> RequestStream:
    try:
        return await state.engine.submit(subs)
    except Exception as e:
        state.reject(type(e).__name__)
        raise


async def collect(request: Request, stream: RequestStream, count: int) -> list[RequestOutput] | None:
    """Final outputs of all choices; None if the client went away first (the requests are aborted)."""
    finals: list[RequestOutput | None] = [None] * count

    async def gather():
        async for i, out in stream:
            if out.finished:
                finals[i] = out

    work = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()                     # re-raises an engine failure
            return finals
        log.info("%s: client disconnected; aborting", request.state.request_id)
        return None
    finally:
        for t in (work, gone):
            t.cancel()
        stream.close()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> list[dict]:
    def entry(tid, lp):
        t = token_text(tokenizer, tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]} for x in lps]


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int) -> dict:
    tokens, offsets = [], []
    for x in lps:
        t = token_text(tokenizer, x.token_id)
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in x.top} for x in lps],
            "text_offset": offsets}


def finish_reason(out: RequestOutput) -> str | None:
    return out.outputs[0].finish_reason


def sse(data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


async def sse_guard(events: AsyncIterator[str], stream: RequestStream, request_id: str) -> AsyncIterator[str]:
    """Runs an event generator; an engine failure mid-stream becomes an error event; leaving
    early (client disconnect, shutdown) aborts the requests."""
    try:
        async for ev in events:
            yield ev
    except asyncio.CancelledError:
        log.info("%s: stream cancelled (client gone or shutdown); aborting", request_id)
        raise
    except Exception as e:
        resp = to_response(e)
        log.warning("%s: stream ended by error: %s", request_id, message_of(e))
        yield sse(json.loads(resp.body) if resp.body else error_body(str(e), "internal_error"))
        yield sse("[DONE]")
    finally:
        stream.close()
