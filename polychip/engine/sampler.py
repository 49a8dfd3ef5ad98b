"""Batched sampling: penalties, logit bias, grammar masks, temperature, top-k / top-p / min-p, seeds,
logprobs."""
from __future__ import annotations

import torch

from polychip.engine.request import Request, TokenLogprob


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place. Repetition over prompt+output (as transformers); frequency/presence over output."""
    vocab = logits.shape[1]
    for i, r in enumerate(reqs):
        p = r.params
        if not p.has_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long,
                                device=logits.device)
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device).scatter_add_(
                0, out, torch.ones_like(out, dtype=logits.dtype))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _suppress_stops(logits: torch.Tensor, reqs: list[Request], eos_ids: frozenset[int]) -> None:
    """Before min_tokens is reached, EOS and stop ids cannot be sampled."""
    for i, r in enumerate(reqs):
        if len(r.output_ids) < r.params.min_tokens:
            banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(eos_ids))
            if banned:
                logits[i, sorted(banned)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place, one scatter for the whole batch."""
    rows, cols, vals = [], [], []
    for i, r in enumerate(reqs):
        for tok, bias in (r.params.logit_bias or {}).items():
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    dev = logits.device
    logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                      torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def _filter(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, vectorised over rows; returns probabilities."""
    dev = logits.device
    temp = torch.tensor([r.params.temperature for r in reqs], device=dev).unsqueeze(1)
    logits = logits / temp
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    min_p = [r.params.min_p for r in reqs]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1) - probs                      # mass before each token
        p = torch.tensor(top_p, device=dev).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cum >= p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, idx, sorted_logits)
    probs = logits.softmax(-1)
    if any(m > 0 for m in min_p):
        m = torch.tensor(min_p, device=dev).unsqueeze(1)
        probs = probs.masked_fill(probs < m * probs.amax(-1, keepdim=True), 0)
    return probs


class Sampler:
    def __init__(self, plugin, seed: int, eos_ids: frozenset[int], grammar=None):
        self.generator = plugin.generator(seed)
        self.eos_ids = eos_ids
        self.grammar = grammar              # GrammarBackend; requests without a matcher never touch it
        self.computed = plugin.event()      # recorded after the step's work, waited on before tokens are read

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        raw = logits
        if any(r.params.has_penalties for r in reqs):
            logits = logits.clone()
            apply_penalties(logits, reqs)
        if any(len(r.output_ids) < r.params.min_tokens for r in reqs):
            logits = logits.clone() if logits is raw else logits
            _suppress_stops(logits, reqs, self.eos_ids)
        if any(r.params.logit_bias for r in reqs):
            logits = logits.clone() if logits is raw else logits
            apply_logit_bias(logits, reqs)
        grammar_rows = self.grammar.rows(reqs) if self.grammar is not None else []
        if grammar_rows:
            # raw stays intact when logprobs or a grammar row's fallback may still read it
            keep_raw = self.grammar.may_empty(reqs, grammar_rows) or any(r.params.logprobs is not None for r in reqs)
            logits = logits.clone() if logits is raw and keep_raw else logits
            self.grammar.mask(logits, raw, reqs, grammar_rows)
        tokens = logits.argmax(-1)
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            rows = torch.tensor(rand, device=logits.device)
            probs = _filter(logits[rows], [reqs[i] for i in rand])
            # exponential race: argmax(p / E) with E ~ Exp(1) samples from p
            noise = torch.empty_like(probs)
            for j, i in enumerate(rand):
                gen = reqs[i].generator or self.generator
                for _ in range(reqs[i].skip_draws):       # a continued answer: the draws its tokens took
                    noise[j].exponential_(generator=gen)
                reqs[i].skip_draws = 0
                noise[j].exponential_(generator=gen)
            tokens[rows] = (probs / noise).argmax(-1)
        self.computed.record()
        self.computed.synchronize()
        token_list = tokens.tolist()
        if grammar_rows:
            self.grammar.accept(reqs, token_list, grammar_rows)
        return token_list, self._logprobs(raw, reqs, token_list)

    @staticmethod
    def _logprobs(raw: torch.Tensor, reqs: list[Request], tokens: list[int]) -> list[TokenLogprob | None]:
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(reqs)
        if not want:
            return out
        lp = raw[want].log_softmax(-1)
        k = max(reqs[i].params.logprobs for i in want)
        top_v, top_i = lp.topk(max(k, 1), dim=-1)
        chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in want], device=raw.device)).squeeze(1)
        top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen.tolist()
        for j, i in enumerate(want):
            n = reqs[i].params.logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_i[j][:n], top_v[j][:n])))
        return out
