"""POST /v1/chat/completions: chat template, reasoning split, streaming and not."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from polychip.errors import InvalidRequestError
from polychip.server.chat_template import render_and_encode
from polychip.server.protocol import ChatCompletionRequest, usage
from polychip.server.reasoning import PARSERS
from polychip.server.serving import (ServerState, chat_logprobs, collect, engine_requests, finish_reason,
                                     request_params, submit, with_max_tokens)
from polychip.server.streaming import ChunkBuilder, sse, sse_guard

RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


async def render_prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """(prompt text, ids), rendered, size-checked and tokenised in the engine's tokenizer threads,
    off the event loop."""
    if not req.messages:
        raise InvalidRequestError("messages must not be empty")
    msgs = [m.for_template() for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs))
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {clash}")
    if req.tools:
        kwargs["tools"] = req.tools
    size_check = lambda text: state.engine.check_prompt_size(text, "messages")   # noqa: E731
    return await state.engine.run_tokenizer(render_and_encode, state.tokenizer, msgs, req.add_generation_prompt,
                                            kwargs, not state.config.special_tokens_in_content, size_check)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    params = request_params(state, req, req.requested_max_tokens, req.num_logprobs())
    prompt_text, ids = await render_prompt(state, req)
    params = with_max_tokens(state, params, [ids], req.requested_max_tokens)
    rid = request.state.request_id
    stream = await submit(state, engine_requests(rid, [ids], params, req.priority))
    parser_cls = PARSERS.get(state.config.reasoning_parser) if req.separate_reasoning else None
    meta = {"id": f"chatcmpl-{rid}", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        events = _stream_events(state, req, stream, meta, prompt_text, len(ids), parser_cls)
        return StreamingResponse(sse_guard(events, stream, rid), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    finals = await collect(request, stream, params.n)
    if finals is None:
        return Response(status_code=499)
    choices = []
    for i, out in enumerate(finals):
        o = out.outputs[0]
        msg = {"role": "assistant", "content": o.text}
        if parser_cls is not None:
            p = parser_cls(prompt_text)
            r1, c1 = p.feed(o.text)
            r2, c2 = p.finish()
            msg = {"role": "assistant", "content": c1 + c2, "reasoning_content": (r1 + r2) or None}
        choice = {"index": i, "message": msg, "finish_reason": finish_reason(out), "stop_reason": o.stop_reason,
                  "logprobs": None}
        if params.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(state.tokenizer, o.logprobs or [])}
        choices.append(choice)
    completion = sum(len(out.token_ids) for out in finals)
    return JSONResponse({**meta, "object": "chat.completion", "choices": choices,
                         "usage": usage(len(ids), completion, finals[0].num_cached_tokens)})


async def _stream_events(state, req, stream, meta, prompt_text, prompt_len, parser_cls):
    n = req.n
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunks = ChunkBuilder(meta, "chat.completion.chunk", "delta", include_usage)
    for i in range(n):
        yield chunks.choice(i, {"role": "assistant", "content": ""})
    parsers = [parser_cls(prompt_text) if parser_cls else None for _ in range(n)]
    seen = [0] * n
    completion_tokens, cached = 0, 0
    async for i, out in stream:
        o = out.outputs[0]
        reasoning, content = "", o.delta_text
        if parsers[i] is not None:
            reasoning, content = parsers[i].feed(o.delta_text)
            if out.finished:
                r2, c2 = parsers[i].finish()
                reasoning, content = reasoning + r2, content + c2
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        lp = None
        if req.logprobs and len(o.token_ids) > seen[i]:
            lp = {"content": chat_logprobs(state.tokenizer, (o.logprobs or [])[seen[i]:])}
        seen[i] = len(o.token_ids)
        if delta or lp:
            yield chunks.choice(i, delta, logprobs=lp)
        if out.finished:
            completion_tokens += len(o.token_ids)
            cached = out.num_cached_tokens if i == 0 else cached
            yield chunks.choice(i, {}, o.finish_reason, stop_reason=o.stop_reason)
    if include_usage:
        yield chunks.usage(usage(prompt_len, completion_tokens, cached))
    yield sse("[DONE]")
