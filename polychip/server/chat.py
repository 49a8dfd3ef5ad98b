"""POST /v1/chat/completions: chat template, tools, structured outputs, reasoning split,
streaming and not."""
from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from polychip.config import RESERVED_TEMPLATE_ARGS
from polychip.errors import InvalidRequestError
from polychip.server.fields import CHAT, check_fields, log_identity
from polychip.server.protocol import ChatCompletionRequest, usage
from polychip.server.reasoning import PARSERS
from polychip.server.serving import (ServerState, chat_logprobs, check_stop_token_ids, collect, finish_reason,
                                     resolve_max_tokens, sse, sse_guard, sub_requests, submit)
from polychip.server.tool_calls import ReplyParser, plan_tools, request_grammar, template_messages


def render_prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    if not req.messages:
        raise InvalidRequestError("messages must not be empty")
    msgs = template_messages([m.for_template() for m in req.messages])
    clash = sorted(set(RESERVED_TEMPLATE_ARGS) & set(req.chat_template_kwargs or {}))
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {clash}")
    kwargs = {**state.chat_defaults, **(req.chat_template_kwargs or {})}   # the request wins
    if req.tools:
        kwargs["tools"] = req.tools
    tok = state.tokenizer
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt, **kwargs)
    except InvalidRequestError:
        raise
    except Exception as e:   # a template may fail in any way on odd input; that is the request's fault
        raise InvalidRequestError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
    return text, tok.encode(text, add_special_tokens=False)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    check_fields(req, CHAT)
    check_stop_token_ids(state, req.stop_token_ids)
    rid = request.state.request_id
    log_identity(req, rid)
    prompt_text, ids = render_prompt(state, req)
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, state.tool_call_parser,
                      state.tokenizer.chat_template, prompt_text)
    grammar = await request_grammar(state.grammar, req.grammar_spec(), plan)
    max_tokens = resolve_max_tokens(state, len(ids), req.requested_max_tokens, "messages")
    params = req.sampling_params(max_tokens, req.num_logprobs())
    if grammar is not None or (plan is not None and plan.stop):
        params = dataclasses.replace(params, grammar=grammar, stop=params.stop + (plan.stop if plan else []))
    stream = await submit(state, sub_requests(rid, [ids], params, req.priority))
    reasoning_cls = PARSERS.get(state.reasoning_parser) if req.separate_reasoning else None

    def reply_parser() -> ReplyParser:
        return ReplyParser(reasoning_cls(prompt_text) if reasoning_cls else None, plan)

    meta = {"id": f"chatcmpl-{rid}", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        events = _stream_events(state, req, stream, meta, len(ids), reply_parser)
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
                  "stop_reason": o.stop_reason, "logprobs": None}
        if params.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(state.tokenizer, o.logprobs or [])}
        choices.append(choice)
    completion = sum(len(out.token_ids) for out in finals)
    return JSONResponse({**meta, "object": "chat.completion", "choices": choices,
                         "usage": usage(len(ids), completion, finals[0].num_cached_tokens)})


async def _stream_events(state, req, stream, meta, prompt_len, reply_parser):
    n = req.n
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    want_logprobs = req.logprobs
    base = {**meta, "object": "chat.completion.chunk"}

    def chunk(i, delta, finish=None, logprobs=None, stop_reason=None):
        c = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop_reason
        body = {**base, "choices": [c]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    parsers = [reply_parser() for _ in range(n)]
    seen = [0] * n
    completion_tokens, cached = 0, 0
    async for i, out in stream:
        o = out.outputs[0]
        delta = parsers[i].feed(o.delta_text, final=out.finished)
        lp = None
        if want_logprobs and len(o.token_ids) > seen[i]:
            lp = {"content": chat_logprobs(state.tokenizer, (o.logprobs or [])[seen[i]:])}
        seen[i] = len(o.token_ids)
        if delta or lp:
            yield chunk(i, delta, logprobs=lp)
        if out.finished:
            completion_tokens += len(o.token_ids)
            cached = out.num_cached_tokens if i == 0 else cached
            yield chunk(i, {}, finish=parsers[i].finish_reason(o.finish_reason), stop_reason=o.stop_reason)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(prompt_len, completion_tokens, cached)})
    yield sse("[DONE]")
