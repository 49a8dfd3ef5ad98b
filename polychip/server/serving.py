"""What chat and text completions share: server state, request limits, submission, collection,
logprobs."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

from fastapi import Request

from polychip.config import ServerConfig
from polychip.engine.async_engine import AsyncEngine, RequestStream, SubRequest
from polychip.engine.request import RequestOutput, TokenLogprob
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import InvalidRequestError
from polychip.http.errors import APIError
from polychip.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("polychip.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    live: object                           # ServerLive: /admin/live's time series (server/live.py)
    metrics: object | None = None          # ServerMetrics when --enable-metrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def grammar(self):
        """The engine's GrammarBackend (thread-safe compile)."""
        return self.engine.grammar

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()
        self.live.error(reason)

    def finished(self, out: RequestOutput) -> None:
        """The engine's hook for each finished request (called in the engine thread)."""
        if self.metrics is not None:
            self.metrics.observe_finished(out)
        self.live.finished(out)


def state_of(request: Request) -> ServerState:
    return request.app.state.polychip


def max_tokens_for(state: ServerState, prompt_len: int, requested: int | None) -> int:
    """The request's max_tokens against the context. None: ``--max-tokens-default``, else the rest
    of the context. A prompt that leaves no room is refused by ``Engine.check_request``."""
    room = state.max_model_len - prompt_len
    if requested is not None:
        if requested > room > 0:
            raise InvalidRequestError(
                f"max_tokens is too large: this model's maximum context length is {state.max_model_len} tokens, "
                f"but you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in "
                "the completion)")
        return requested
    default = state.config.max_tokens_default
    room = max(room, 1)
    return room if default is None else min(default, room)


def check_stop_limits(cfg: ServerConfig, stop: list[str], stop_token_ids: list[int]) -> None:
    """Stop strings are matched at every step on the engine thread: bound what one request brings."""
    if len(stop) > cfg.max_stop_strings:
        raise InvalidRequestError(f"stop has {len(stop)} strings; this server allows at most "
                                  f"{cfg.max_stop_strings} (--max-stop-strings)")
    chars = sum(map(len, stop))
    if chars > cfg.max_stop_chars:
        raise InvalidRequestError(f"stop strings have {chars} characters in all; this server allows at most "
                                  f"{cfg.max_stop_chars} (--max-stop-chars)")
    if len(stop_token_ids) > cfg.max_stop_strings:
        raise InvalidRequestError(f"stop_token_ids has {len(stop_token_ids)} ids; this server allows at most "
                                  f"{cfg.max_stop_strings} (--max-stop-strings)")


def request_params(state: ServerState, req: ChatCompletionRequest | CompletionRequest, requested: int | None,
                   logprobs: int | None, num_prompts: int = 1) -> SamplingParams:
    """The request's sampling params, every field checked before its prompt is tokenised (so a bad
    request costs no tokenisation); ``with_max_tokens`` fixes max_tokens once the prompts are known."""
    params = req.sampling_params(state.max_model_len if requested is None else requested, logprobs)
    check_stop_limits(state.config, params.stop, params.stop_token_ids)
    state.engine.check_group_size(num_prompts * params.n)
    return params


def with_max_tokens(state: ServerState, params: SamplingParams, prompts: list[list[int]],
                    requested: int | None) -> SamplingParams:
    """One max_tokens for all prompts: the requested one if every prompt leaves room for it;
    None means ``--max-tokens-default`` or the context left after the longest prompt."""
    max_tokens = min(max_tokens_for(state, len(ids), requested) for ids in prompts)
    return dataclasses.replace(params, max_tokens=max_tokens)


def engine_requests(request_id: str, prompts: list[list[int]], params: SamplingParams, priority: int,
                    remote=None, continuation: list[int] | None = None) -> list[SubRequest]:
    """One engine request per (prompt, choice), ids ``<request_id>-<k>`` in choice order; ``remote``: the
    prefill side each one's prompt runs on (a decode side's RemotePrefill)."""
    choices = params.choices()
    if continuation and (len(prompts) > 1 or len(choices) > 1):
        raise InvalidRequestError("continue_token_ids continues one answer: one prompt and n=1 only")
    more = tuple(continuation or ())
    return [SubRequest(f"{request_id}-{i * len(choices) + j}", ids, child, priority, remote, more)
            for i, ids in enumerate(prompts) for j, child in enumerate(choices)]


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
