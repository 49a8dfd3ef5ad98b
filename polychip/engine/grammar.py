"""Structured outputs through xgrammar: what a request asks for (``GrammarSpec``, in
``grammar_spec.py``, which needs no torch), compilation
(cached per spec, thread-safe, so the server compiles off the engine thread), and the batched
token mask the sampler applies.

xgrammar is imported on first use: building its tokenizer table costs a few seconds for a
150k vocabulary, and a server that never sees a grammar should not pay it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from typing import TYPE_CHECKING

import torch

from polychip.engine.grammar_spec import GrammarSpec, clean_message
from polychip.errors import InvalidRequestError

if TYPE_CHECKING:
    from polychip.engine.request import Request
    from polychip.models.tokenizer import Tokenizer

log = logging.getLogger("polychip.grammar")

COMPILE_CACHE_BYTES = 512 * 2**20


def fill_threads() -> int:
    """Threads for the per-step mask fill: one per four cores, at most 8. On a small machine the
    model's own threads hold the cores, and a second fill thread cost more than it saved (2.1 ms
    against 0.3 ms for 16 rows on 2 shared cores)."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


class GrammarBackend:
    """One per engine. ``compile`` and ``matcher`` may run in any thread; ``apply_mask`` and
    ``accept`` run in the engine thread."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: frozenset[int],
                 compile_threads: int = 2):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_threads = compile_threads
        self._lock = threading.Lock()
        self._xgr = self._compiler = self._batch = self._bitmask = None

    # set-up (first use)
    def _ensure(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from transformers import PreTrainedTokenizerFast
                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.tok)
                info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self.compile_threads,
                                                          cache_limit_bytes=COMPILE_CACHE_BYTES)
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=fill_threads())
                self._xgr = xgrammar
                log.info("xgrammar ready (vocab %d, %s)", info.vocab_size, info.vocab_type.name)
        return self._compiler

    def prepare(self) -> None:
        """Load xgrammar and build the tokenizer table now (e.g. in a background thread)."""
        self._ensure()

    # compilation
    def compile(self, spec: GrammarSpec):
        """The compiled grammar (cached by xgrammar per spec); a bad spec is an InvalidRequestError
        naming the field and xgrammar's reason."""
        comp = self._ensure()
        try:   # JSON without free whitespace: a model cannot pad a value with spaces until max_tokens
            if spec.kind == "json_schema":
                return comp.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return comp.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return comp.compile_regex(spec.source)
            if spec.kind == "ebnf":
                return comp.compile_grammar(spec.source)
            if spec.kind == "choice":
                alts = " | ".join(_ebnf_literal(c) for c in json.loads(spec.source))
                return comp.compile_grammar(f"root ::= {alts}")
            return comp.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"{spec.param or spec.kind}: invalid {spec.kind.replace('_', ' ')}: "
                                      f"{clean_message(e)}") from None

    def compiled(self, spec: GrammarSpec) -> GrammarSpec:
        """``spec`` carrying its compiled grammar, so the engine thread only makes a matcher."""
        return dataclasses.replace(spec, compiled=self.compile(spec))

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for one request (compiled here unless the spec already carries it)."""
        compiled = spec.compiled if spec.compiled is not None else self.compile(spec)
        return self._xgr.GrammarMatcher(compiled)

    # the engine thread: mask before sampling, advance after
    @staticmethod
    def rows(reqs: list["Request"]) -> list[int]:
        """Rows of the batch whose request has a grammar still running."""
        return [i for i, r in enumerate(reqs) if r.matcher is not None and not r.matcher.is_terminated()]

    def apply_mask(self, logits: torch.Tensor, reqs: list["Request"], rows: list[int]) -> None:
        """In place: in ``rows`` only, tokens the grammar forbids get -inf; the bitmask is filled
        for those rows in one batched call and applied in one kernel."""
        xgr = self._xgr
        if self._bitmask is None or self._bitmask.shape[0] < len(reqs):   # reused: fill overwrites its rows
            self._bitmask = xgr.allocate_token_bitmask(max(len(reqs), 8), self.vocab_size)
        bitmask = self._bitmask
        self._batch.batch_fill_next_token_bitmask([reqs[i].matcher for i in rows], bitmask, rows)
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows,
                                            backend="cpu")
        else:   # portable: plain torch ops on whatever device the plugin computes on
            xgr.apply_token_bitmask_inplace(logits, bitmask[:len(reqs)].to(logits.device),
                                            vocab_size=self.vocab_size, indices=rows, backend="torch_native")
        if logits.shape[1] > self.vocab_size:
            logits[rows, self.vocab_size:] = float("-inf")

    @staticmethod
    def may_empty(reqs: list["Request"], rows: list[int]) -> list[int]:
        """Rows the sampler's own -inf (EOS banned until min_tokens) could leave with nothing."""
        return [i for i in rows if len(reqs[i].output_ids) < reqs[i].params.min_tokens]

    def mask(self, logits: torch.Tensor, raw: torch.Tensor, reqs: list["Request"], rows: list[int]) -> None:
        """Apply the grammar to ``logits`` (already biased and penalised). A row the grammar leaves
        empty (min_tokens banning the stop token a finished grammar needs) gets the grammar's
        mask over its raw logits instead: the grammar wins. Only such rows are checked."""
        self.apply_mask(logits, reqs, rows)
        suspects = self.may_empty(reqs, rows)
        if suspects:
            dead = torch.isneginf(logits[suspects]).all(-1).tolist()
            fix = [i for i, d in zip(suspects, dead) if d]
            if fix:
                logits[fix] = raw[fix]
                self.apply_mask(logits, reqs, fix)

    @staticmethod
    def accept(reqs: list["Request"], tokens: list[int], rows: list[int]) -> None:
        """Advance each matcher by its sampled token. A refused token (possible only when the
        grammar allowed nothing) marks the request, which then ends."""
        for i in rows:
            r = reqs[i]
            if not r.matcher.accept_token(tokens[i]):
                log.warning("%s: the grammar refused token %d; finishing the request", r.request_id, tokens[i])
                r.grammar_failed = True


def _ebnf_literal(text: str) -> str:
    """An EBNF string literal for ``text`` (xgrammar reads JSON-style escapes)."""
    return json.dumps(text, ensure_ascii=True)


def grammar_done(req: "Request") -> bool:
    """The grammar is complete (its stop token accepted) or refused a token: the request ends."""
    m = req.matcher
    return m is not None and (m.is_terminated() or req.grammar_failed)
