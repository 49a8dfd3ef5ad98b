"""Stop checks and the text a request may already stream without leaking a stop string."""
from __future__ import annotations

from polychip.engine.grammar import grammar_done
from polychip.engine.request import Request


def check_stop(req: Request, token: int, eos_ids: frozenset[int], max_model_len: int) -> None:
    """Sets ``finish_reason`` (and ``stop_reason``) when ``token`` ends the request. Updates text."""
    p = req.params
    n_out = len(req.output_ids)
    if n_out >= p.min_tokens:
        if token in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        elif not p.ignore_eos and token in eos_ids:
            req.finish_reason = "stop"
    delta = req.detok.add(token)
    if req.finish_reason is None and delta:
        req.text += delta
        if p.stop and n_out >= p.min_tokens:
            _check_stop_strings(req, len(delta))
    if req.finish_reason is None and grammar_done(req):      # the structured output is complete
        req.finish_reason = "stop"
    if req.finish_reason is None and (n_out >= p.max_tokens or req.num_tokens >= max_model_len):
        req.finish_reason = "length"


def _check_stop_strings(req: Request, delta_len: int) -> None:
    longest = max(len(s) for s in req.params.stop)
    begin = max(0, len(req.text) - delta_len - longest + 1)   # only new text can complete a match
    best = None
    for s in req.params.stop:
        i = req.text.find(s, begin)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is not None:
        i, s = best
        req.text = req.text[:i + len(s)] if req.params.include_stop_str_in_output else req.text[:i]
        req.finish_reason, req.stop_reason = "stop", s


def streamable_len(req: Request) -> int:
    """How much of ``req.text`` can be sent now: all of it once finished; otherwise hold back
    a tail that could still grow into a stop string."""
    if req.finish_reason is not None or not req.params.stop:
        return len(req.text)
    return len(req.text) - held_back(req.text, req.params.stop)


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of a stop string. Looks only
    at the last ``len(stop) - 1`` characters, with C-level string searches, so its cost depends on
    the stop strings, never on the length of the output."""
    hold = 0
    for s in stops:
        if len(s) < 2:
            continue
        tail = text[len(text) - min(len(text), len(s) - 1):]
        i = tail.find(s[0])
        while i != -1 and len(tail) - i > hold:      # the first fitting start is the longest end
            if s.startswith(tail[i:]):
                hold = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return hold
