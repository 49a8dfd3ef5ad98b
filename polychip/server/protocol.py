"""OpenAI request bodies (plus the vLLM / SGLang extension fields) as pydantic models.

Unknown fields are ignored, as OpenAI-compatible servers do; wrong types are a 400. The models are
strict, as OpenAI's API is: a string is not a number and 1 is not a boolean (an integer is still a
valid float). Range checks live in ``SamplingParams`` so the offline API and the server agree.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from polychip.engine.sampling_params import MAX_N, SamplingParams
from polychip.errors import InvalidRequestError
from polychip.server.fields import RefusedFields
from polychip.server.structured import StructuredFields

MAX_TOP_LOGPROBS = 20
# integers the engine hands to torch must fit in int64; seeds leave room for seed + j (n choices)
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
Seed = Annotated[int, Field(ge=-2**63, le=2**63 - 1 - MAX_N)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict, RefusedFields, StructuredFields):
    """Fields shared by chat and text completions (the structured-output ones and the refused ones
    come from their owners: server/structured.py, server/fields.py)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM / SGLang extensions
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = False
    logit_bias: dict[str, float] | None = None
    priority: Int64 = 0
    # polychip's request migration (the router resends a request whose replica failed mid-answer):
    # tokens already generated, which the answer continues; and the token ids of each chunk
    continue_token_ids: list[Int64] | None = None
    return_token_ids: bool = False
    # SGLang's prefill/decode fields: on a decode side, the prefill side that runs this prompt
    bootstrap_host: StrictStr | None = None
    bootstrap_port: Annotated[int, Field(ge=1, le=65535)] | None = None

    def remote_prefill(self):
        """The prefill side named by bootstrap_host / bootstrap_port, or None (both or neither)."""
        if (self.bootstrap_host is None) != (self.bootstrap_port is None):
            raise InvalidRequestError("bootstrap_host and bootstrap_port name a prefill side together: give both")
        if self.bootstrap_host is None:
            return None
        from polychip.engine.disagg.decode import RemotePrefill
        return RemotePrefill(self.bootstrap_host, self.bootstrap_port)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0, seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.token_logit_bias())

    def token_logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as strings."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().isdigit():
                raise InvalidRequestError(f"logit_bias keys must be token ids (digits), got {key!r}")
            out[int(key)] = bias
        return out


class ContentPart(_Strict):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow")   # name, tool_calls, tool_call_id, reasoning_content...
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """A plain dict for the chat template; text parts joined, other parts refused."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"messages: content part of type {part.type!r} is not "
                                              "supported (text only)")
                texts.append(part.text)
            msg["content"] = "".join(texts)
        msg.setdefault("content", "")
        return msg


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # extensions
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    separate_reasoning: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true")
            return None
        return self.top_logprobs or 0


# a prompt: text, texts, token ids, or lists of token ids (strict: no coercion between them)
Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_card(name: str, created: int, max_model_len: int, root: str) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "polychip", "root": root,
            "max_model_len": max_model_len}


