"""A request's sampling params and its first token's logprob, as they cross to the prefill side and back.

The prefill side samples the first token with the request's own params (temperature, seed, logit
bias, grammar, min_tokens...) and ``max_tokens`` 1; the decode side books that token as its own."""
from __future__ import annotations

import dataclasses
from typing import Any

from polychip.engine.grammar_spec import GrammarSpec
from polychip.engine.request import TokenLogprob
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import InvalidRequestError

_SENT = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty",
         "presence_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "logit_bias")


def params_to_wire(p: SamplingParams) -> dict[str, Any]:
    out = {k: getattr(p, k) for k in _SENT}
    out["min_tokens"] = min(p.min_tokens, 1)
    if p.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    if p.grammar is not None:
        out["grammar"] = {"kind": p.grammar.kind, "source": p.grammar.source}
    return out


def params_from_wire(d: dict[str, Any]) -> SamplingParams:
    """The first token's params; InvalidRequestError for anything a SamplingParams would refuse."""
    unknown = set(d) - set(_SENT) - {"grammar"}
    if unknown:
        raise InvalidRequestError(f"the decode side sent unknown sampling params {sorted(unknown)}")
    kw = dict(d)
    try:
        if kw.get("logit_bias"):
            kw["logit_bias"] = {int(k): float(v) for k, v in kw["logit_bias"].items()}
        if kw.get("grammar") is not None:
            kw["grammar"] = GrammarSpec(kw["grammar"]["kind"], kw["grammar"]["source"], "grammar")
        return SamplingParams(max_tokens=1, **kw)
    except (TypeError, ValueError, KeyError) as e:
        raise InvalidRequestError(f"the decode side sent bad sampling params: {e}") from None


def logprob_to_wire(lp: TokenLogprob | None) -> dict | None:
    return None if lp is None else dataclasses.asdict(lp)


def logprob_from_wire(d: dict | None) -> TokenLogprob | None:
    if d is None:
        return None
    return TokenLogprob(int(d["token_id"]), float(d["logprob"]), [(int(t), float(v)) for t, v in d["top"]])
