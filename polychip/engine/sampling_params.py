"""SamplingParams: what a request asks of the sampler and the stop checker."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from polychip.engine.grammar_spec import GrammarSpec
from polychip.errors import InvalidRequestError

MAX_N = 64
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1
MAX_LOGIT_BIAS = 100.0           # |bias| bound, as OpenAI's
GREEDY_BELOW = 1e-5      # temperatures this small are greedy (dividing by them overflows)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None     # None: off; k: chosen token plus k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = False   # only visible with skip_special_tokens=False
    logit_bias: dict[int, float] | None = None     # token id -> added to its logit
    grammar: GrammarSpec | None = None              # structured output (polychip.engine.grammar)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def _bad(self, param: str, msg: str):
        raise InvalidRequestError(f"{param} {msg}")

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                self._bad(name, f"must be a finite number, got {getattr(self, name)}")
        if not 1 <= self.n <= MAX_N:
            self._bad("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.temperature < 0:
            self._bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            self._bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            self._bad("top_k", f"must be -1 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            self._bad("seed", f"must be in [0, 2**63), got {self.seed}")
        if not 0 <= self.min_p <= 1:
            self._bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            self._bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                self._bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens < 1:
            self._bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            self._bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            self._bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for tok, bias in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or tok < 0:
                self._bad("logit_bias", f"keys must be token ids >= 0, got {tok!r}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                self._bad("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                        f"got {bias} for token {tok}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            self._bad("grammar", f"must be a GrammarSpec, got {type(self.grammar).__name__}")

    def choices(self) -> list["SamplingParams"]:
        """The ``n`` choices as ``n`` one-choice params (the engine runs one sequence each);
        choice ``j`` samples with ``seed + j``, so each choice is reproducible on its own."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + j)
                for j in range(self.n)]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
