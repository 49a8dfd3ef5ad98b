"""POST /v1/chat/completions: chat template, tools, structured outputs, reasoning split,
streaming and not."""
from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from polychip.config import RESERVED_TEMPLATE_ARGS
from polychip.errors import InvalidRequestError
from polychip.server.chat_template import render_and_encode
from polychip.server.fields import CHAT, check_fields, log_identity
from polychip.server.protocol import ChatCompletionRequest, usage
from polychip.server.reasoning import PARSERS
from polychip.server.serving import (ServerState, chat_logprobs, collect, engine_requests, finish_reason,
                                     request_params, submit, with_max_tokens)
from polychip.server.streaming import ChunkBuilder, sse, sse_guard
from polychip.server.tool_calls import ReplyParser, plan_tools, request_grammar, template_messages


async def render_prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """(prompt text, ids), rendered, size-checked and tokenised in the engine's tokenizer threads,
    off the event loop."""
    if not req.messages:
        raise InvalidRequestError("messages must not be empty")
    msgs = template_messages([m.for_template() for m in req.messages])
    clash = sorted(set(RESERVED_TEMPLATE_ARGS) & set(req.chat_template_kwargs or {}))
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {clash}")
    kwargs = {**state.config.chat_template_defaults(), **(req.chat_template_kwargs or {})}   # the request wins
    if req.tools:
        kwargs["tools"] = req.tools
    size_check = lambda text: state.engine.check_prompt_size(text, "messages")   # noqa: E731
    return await state.engine.run_tokenizer(render_and_encode, state.tokenizer, msgs, req.add_generation_prompt,
                                            kwargs, not state.config.special_tokens_in_content, size_check)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    check_fields(req, CHAT)
    rid = request.state.request_id
    log_identity(req, rid)
    params = request_params(state, req, req.requested_max_tokens, req.num_logprobs())
    prompt_text, ids = await render_prompt(state, req)
    cont = req.continue_token_ids or []
    params = with_max_tokens(state, params, [ids + cont], req.requested_max_tokens)
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, state.config.tool_call_parser,
                      state.tokenizer.chat_template, prompt_text)
    grammar = await request_grammar(state.grammar, req.grammar_spec(), plan)
    if grammar is not None or (plan is not None and plan.stop):
        params = dataclasses.replace(params, grammar=grammar, stop=params.stop + (plan.stop if plan else []))
    stream = await submit(state, engine_requests(rid, [ids], params, req.priority, req.remote_prefill(), cont))
    reasoning_cls = PARSERS.get(state.config.reasoning_parser) if req.separate_reasoning else None

    def reply_parser() -> ReplyParser:
        return ReplyParser(reasoning_cls(prompt_text) if reasoning_cls else None, plan)

    meta = {"id": f"chatcmpl-{rid}", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        events = _stream_events(state, req, stream, meta, len(ids), reply_parser, len(cont))
        return StreamingResponse(sse_guard(events, stream, rid), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    finals = await collect(request, stream, params.n)
    if finals is None:
        return Response(status_code=499)
    choices = []
    for i, out in enumerate(finals):
        o = out.outputs[0]
        parser = reply_parser()
        msg = parser.message(o.text)
        choice = {"index": i, "message": msg, "finish_reason": parser.finish_reason(finish_reason(out)),
                  "stop_reason": o.stop_reason, "logprobs": None,
                  **({"token_ids": list(o.token_ids)} if req.return_token_ids else {})}
        if params.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(state.tokenizer, o.logprobs or [])}
        choices.append(choice)
    completion = sum(len(out.token_ids) for out in finals) + len(cont)     # a continuation's tokens count
    return JSONResponse({**meta, "object": "chat.completion", "choices": choices,
                         "usage": usage(len(ids), completion, finals[0].num_cached_tokens)})


async def _stream_events(state, req, stream, meta, prompt_len, reply_parser, continued=0):
    n = req.n
    chunks = ChunkBuilder(meta, "chat.completion.chunk", "delta", req.stream_options)
    for i in range(n):
        yield chunks.choice(i, {"role": "assistant", "content": ""})
    parsers = [reply_parser() for _ in range(n)]
    seen = [0] * n
    completion_tokens, cached = 0, 0
    async for i, out in stream:
        o = out.outputs[0]
        delta = parsers[i].feed(o.delta_text, final=out.finished)
        lp = None
        if req.logprobs and len(o.token_ids) > seen[i]:
            lp = {"content": chat_logprobs(state.tokenizer, (o.logprobs or [])[seen[i]:])}
        ids = list(o.token_ids[seen[i]:]) if req.return_token_ids else None
        seen[i] = len(o.token_ids)
        so_far = usage(prompt_len, sum(seen) + continued) if chunks.continuous else None
        if delta or lp or ids:
            yield chunks.choice(i, delta, logprobs=lp, token_ids=ids, usage=so_far)
        if out.finished:
            completion_tokens += len(o.token_ids) + continued
            cached = out.num_cached_tokens if i == 0 else cached
            yield chunks.choice(i, {}, parsers[i].finish_reason(o.finish_reason), stop_reason=o.stop_reason,
                                usage=so_far)
    if chunks.include_usage:
        yield chunks.usage(usage(prompt_len, completion_tokens, cached))
    yield sse("[DONE]")
