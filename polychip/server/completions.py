"""POST /v1/completions: prompt as text, texts, token ids or lists of token ids."""
from __future__ import annotations

import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from polychip.errors import InvalidRequestError
from polychip.server.fields import COMPLETIONS, check_fields, log_identity
from polychip.server.protocol import MAX_TOP_LOGPROBS, CompletionRequest, usage
from polychip.server.serving import (ServerState, collect, completion_logprobs, engine_requests, finish_reason,
                                     request_params, submit, with_max_tokens)
from polychip.server.streaming import ChunkBuilder, sse, sse_guard
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


async def tokenize_prompts(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of every prompt; texts are size-checked, then tokenised off the event loop."""
    texts = [p for p in prompts if isinstance(p, str)]
    for t in texts:
        state.engine.check_prompt_size(t, "prompt")
    encode = state.tokenizer.encode
    encoded = iter(await state.engine.run_tokenizer(lambda: [encode(t) for t in texts]) if texts else [])
    ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
    if any(not x for x in ids):
        raise InvalidRequestError("prompt is empty after tokenisation")
    return ids


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    logprobs = _check_unsupported(req)
    rid = request.state.request_id
    log_identity(req, rid)
    tok = state.tokenizer
    params = request_params(state, req, req.max_tokens, logprobs, len(req.prompts()))
    grammar = await compile_off_loop(state.grammar, req.grammar_spec())
    prompts = await tokenize_prompts(state, req.prompts())
    cont = req.continue_token_ids or []
    params = with_max_tokens(state, params, [ids + cont for ids in prompts], req.max_tokens)
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    best_of = req.best_of if req.best_of is not None and req.best_of > params.n else None
    if best_of is not None:   # candidates carry their chosen-token logprobs to be ranked
        state.engine.check_group_size(len(prompts) * best_of)
        params = dataclasses.replace(params, n=best_of, logprobs=logprobs or 0)
    stream = await submit(state, engine_requests(rid, prompts, params, req.priority, req.remote_prefill(), cont))
    echoes = [(p if isinstance(p, str) else tok.decode(ids)) if req.echo else ""
              for p, ids in zip(req.prompts(), prompts)]
    count = len(prompts) * params.n
    meta = {"id": f"cmpl-{rid}", "created": int(time.time()), "model": state.model_name}
    prompt_tokens = sum(len(ids) for ids in prompts)
    if req.stream:
        events = _stream_events(state, req, stream, meta, echoes, prompt_tokens, len(cont))
        return StreamingResponse(sse_guard(events, stream, rid), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    finals = await collect(request, stream, count)
    if finals is None:
        return Response(status_code=499)
    # every candidate was generated; a continuation's earlier tokens are part of the answer
    completion = sum(len(out.token_ids) for out in finals) + len(cont)
    if best_of is not None:
        finals = best_of_n(finals, best_of, req.n)
        params = dataclasses.replace(params, n=req.n)
    choices = []
    for i, out in enumerate(finals):
        o = out.outputs[0]
        choices.append({"index": i, "text": echoes[i // params.n] + o.text, "finish_reason": finish_reason(out),
                        "stop_reason": o.stop_reason,
                        **({"token_ids": list(o.token_ids)} if req.return_token_ids else {}),
                        "logprobs": None if logprobs is None else completion_logprobs(tok, o.logprobs or [], 0)})
    cached = sum(out.num_cached_tokens for out in finals[::params.n])
    return JSONResponse({**meta, "object": "text_completion", "choices": choices,
                         "usage": usage(prompt_tokens, completion, cached)})


def best_of_n(finals: list, best_of: int, n: int) -> list:
    """Per prompt, the n of ``best_of`` candidates with the highest cumulative logprob, best first."""
    out = []
    for start in range(0, len(finals), best_of):
        group = finals[start:start + best_of]
        score = [sum(lp.logprob for lp in (g.outputs[0].logprobs or [])) for g in group]
        out.extend(group[j] for j in sorted(range(len(group)), key=lambda j: -score[j])[:n])
    return out


async def _stream_events(state, req, stream, meta, echoes, prompt_tokens, continued=0):
    n = req.n
    chunks = ChunkBuilder(meta, "text_completion", "text", req.stream_options)
    count = len(echoes) * n
    seen, offsets = [0] * count, [0] * count
    for i in range(count):
        if echoes[i // n]:
            yield chunks.choice(i, echoes[i // n])
    completion_tokens, cached = 0, 0
    async for i, out in stream:
        o = out.outputs[0]
        lp = None
        if req.logprobs is not None and len(o.token_ids) > seen[i]:
            lp = completion_logprobs(state.tokenizer, (o.logprobs or [])[seen[i]:], offsets[i])
            offsets[i] += sum(len(t) for t in lp["tokens"])
        ids = list(o.token_ids[seen[i]:]) if req.return_token_ids else None
        seen[i] = len(o.token_ids)
        so_far = usage(prompt_tokens, sum(seen) + continued) if chunks.continuous else None
        if o.delta_text or lp or ids:
            yield chunks.choice(i, o.delta_text, logprobs=lp, token_ids=ids, usage=so_far)
        if out.finished:
            completion_tokens += len(o.token_ids) + continued
            cached += out.num_cached_tokens if i % n == 0 else 0      # per prompt, as the JSON answer counts
            yield chunks.choice(i, "", o.finish_reason, stop_reason=o.stop_reason, usage=so_far)
    if chunks.include_usage:
        yield chunks.usage(usage(prompt_tokens, completion_tokens, cached))
    yield sse("[DONE]")
