"""POST /v1/completions: prompt as text, texts, token ids or lists of token ids."""
from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from polychip.errors import InvalidRequestError
from polychip.server.fields import COMPLETIONS, check_fields, log_identity
from polychip.server.protocol import MAX_TOP_LOGPROBS, CompletionRequest, usage
from polychip.server.serving import (ServerState, check_stop_token_ids, collect, completion_logprobs,
                                     finish_reason, resolve_max_tokens, sse, sse_guard, sub_requests, submit)
from polychip.server.structured import compile_off_loop


def _check_unsupported(req: CompletionRequest) -> int | None:
    check_fields(req, COMPLETIONS)
    if req.best_of is not None:
        if req.best_of < req.n:
            raise InvalidRequestError(f"best_of must be >= n ({req.n}), got {req.best_of}")
        if req.best_of > req.n and req.stream:
            raise InvalidRequestError("best_of > n cannot stream: the best are known only at the end")
    if req.echo and req.logprobs is not None:
        raise InvalidRequestError("echo together with logprobs is not supported (no prompt logprobs)")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}")
    return req.logprobs


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    check_stop_token_ids(state, req.stop_token_ids)
    logprobs = _check_unsupported(req)
    log_identity(req, request.state.request_id)
    grammar = await compile_off_loop(state.grammar, req.grammar_spec())
    tok = state.tokenizer
    prompts = [tok.encode(p) if isinstance(p, str) else p for p in req.prompts()]
    if any(not ids for ids in prompts):
        raise InvalidRequestError("prompt is empty after tokenisation")
    # one max_tokens for all prompts: the requested one if every prompt leaves room for it;
    # null means the context left after the longest prompt
    max_tokens = min(resolve_max_tokens(state, len(ids), req.max_tokens, "prompt") for ids in prompts)
    params = req.sampling_params(max_tokens, logprobs)
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    best_of = req.best_of if req.best_of is not None and req.best_of > params.n else None
    if best_of is not None:   # candidates carry their chosen-token logprobs to be ranked
        params = dataclasses.replace(params, n=best_of, logprobs=logprobs or 0)
    rid = request.state.request_id
    stream = await submit(state, sub_requests(rid, prompts, params, req.priority))
    echoes = [(p if isinstance(p, str) else tok.decode(ids)) if req.echo else ""
              for p, ids in zip(req.prompts(), prompts)]
    count = len(prompts) * params.n
    meta = {"id": f"cmpl-{rid}", "created": int(time.time()), "model": state.model_name}
    prompt_tokens = sum(len(ids) for ids in prompts)
    if req.stream:
        events = _stream_events(state, req, stream, meta, echoes, prompt_tokens)
        return StreamingResponse(sse_guard(events, stream, rid), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    finals = await collect(request, stream, count)
    if finals is None:
        return Response(status_code=499)
    completion = sum(len(out.token_ids) for out in finals)      # every candidate was generated
    if best_of is not None:
        finals = best_of_n(finals, best_of, req.n)
        params = dataclasses.replace(params, n=req.n)
    choices = []
    for i, out in enumerate(finals):
        o = out.outputs[0]
        choices.append({"index": i, "text": echoes[i // params.n] + o.text, "finish_reason": finish_reason(out),
                        "stop_reason": o.stop_reason,
                        "logprobs": None if logprobs is None else completion_logprobs(tok, o.logprobs or [], 0)})
    cached = sum(out.num_cached_tokens for out in finals[::params.n])
    return JSONResponse({**meta, "object": "text_completion", "choices": choices,
                         "usage": usage(prompt_tokens, completion, cached)})


def best_of_n(finals: list, best_of: int, n: int) -> list:
    """Per prompt, the n of ``best_of`` candidates with the highest cumulative logprob (in order)."""
    out = []
    for start in range(0, len(finals), best_of):
        group = finals[start:start + best_of]
        score = [sum(lp.logprob for lp in (g.outputs[0].logprobs or [])) for g in group]
        out.extend(group[j] for j in sorted(range(len(group)), key=lambda j: -score[j])[:n])
    return out


async def _stream_events(state, req, stream, meta, echoes, prompt_tokens):
    n = req.n
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = {**meta, "object": "text_completion"}

    def chunk(i, text, finish=None, logprobs=None, stop_reason=None):
        c = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop_reason
        body = {**base, "choices": [c]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    count = len(echoes) * n
    seen, offsets = [0] * count, [0] * count
    for i in range(count):
        if echoes[i // n]:
            yield chunk(i, echoes[i // n])
    completion_tokens = 0
    async for i, out in stream:
        o = out.outputs[0]
        lp = None
        if req.logprobs is not None and len(o.token_ids) > seen[i]:
            lp = completion_logprobs(state.tokenizer, (o.logprobs or [])[seen[i]:], offsets[i])
            offsets[i] += sum(len(t) for t in lp["tokens"])
        seen[i] = len(o.token_ids)
        if o.delta_text or lp:
            yield chunk(i, o.delta_text, logprobs=lp)
        if out.finished:
            completion_tokens += len(o.token_ids)
            yield chunk(i, "", finish=o.finish_reason, stop_reason=o.stop_reason)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    yield sse("[DONE]")
