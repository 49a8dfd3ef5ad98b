"""Every request field the server knows, with its status: honoured, or refused with a 400 that
names it. The table is the one source of the refusals here and of docs/api-fields.md
(``python -m polychip.server.fields`` prints it; a test keeps the file in step).

Fields no OpenAI-compatible server knows are ignored, as OpenAI's own API does with unknown
fields; every field of OpenAI's request and of the vLLM / SGLang extensions is listed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

from polychip.errors import InvalidRequestError
from polychip.http.logs import printable

log = logging.getLogger("polychip.server")

HONOURED, PARTLY, REFUSED = "honoured", "honoured in part", "refused"
CHAT, COMPLETIONS, BOTH = "chat", "completions", "chat, completions"


@dataclass(frozen=True)
class Field:
    name: str
    endpoints: str
    status: str
    note: str
    refuse: Callable[[Any], str | None] | None = None    # value -> why it is refused, or None


def _set(value) -> str | None:
    return "is not supported" if value is not None else None


def _true(value) -> str | None:
    return "is not supported" if value else None


def _only(*ok):
    def check(value):
        return None if value is None or value in ok else f"must be one of {list(ok)} on this server"
    return check


def _modalities(value):
    return None if value is None or list(value) == ["text"] else "must be ['text'] (this server generates text)"


FIELDS: tuple[Field, ...] = (
    # OpenAI, both endpoints
    Field("model", BOTH, HONOURED, "must name the served model (or be omitted); another name is a 404"),
    Field("n", BOTH, HONOURED, "1-64 choices"),
    Field("temperature", BOTH, HONOURED, ">= 0; below 1e-5 is greedy"),
    Field("top_p", BOTH, HONOURED, "(0, 1]"),
    Field("seed", BOTH, HONOURED, "per-request generator; choice j uses seed + j"),
    Field("stop", BOTH, HONOURED, "strings; cut from the text unless include_stop_str_in_output"),
    Field("stream", BOTH, HONOURED, "server-sent events, ending with [DONE]"),
    Field("stream_options.include_usage", BOTH, HONOURED, "a last chunk with usage"),
    Field("stream_options.continuous_usage_stats", BOTH, HONOURED, "with include_usage, every chunk carries the "
          "usage so far (vLLM's extension; GuideLLM asks for it)"),
    Field("presence_penalty", BOTH, HONOURED, "[-2, 2], over the output"),
    Field("frequency_penalty", BOTH, HONOURED, "[-2, 2], over the output"),
    Field("logit_bias", BOTH, HONOURED, "token id (a string) -> [-100, 100] added to its logit; ids outside "
                                        "the vocabulary are a 400"),
    Field("user", BOTH, HONOURED, "written to the server log with the request id"),
    Field("max_tokens", BOTH, HONOURED, "chat: null means --max-tokens-default, else the rest of the context; completions: "
                                        "default 16"),
    # OpenAI, chat
    Field("messages", CHAT, HONOURED, "roles system, developer, user, assistant (with tool_calls), tool; "
                                      "text content parts; other part types are a 400"),
    Field("max_completion_tokens", CHAT, HONOURED, "wins over max_tokens"),
    Field("logprobs", BOTH, HONOURED, "chat: bool with top_logprobs <= 20; completions: int <= 20"),
    Field("top_logprobs", CHAT, HONOURED, "0-20, needs logprobs"),
    Field("response_format", CHAT + ", completions (extension)", HONOURED,
          "text, json_object, json_schema (strict true or false: the schema is enforced either way, and properties "
          "it does not list are not generated, as in vLLM and SGLang); enforced by an xgrammar "
          "token mask; an invalid schema is a 400 naming the problem"),
    Field("tools", CHAT, HONOURED, "function tools, rendered through the chat template; a 400 when the template "
                                   "cannot render tools (SmolLM2's) or shows no call format the server parses"),
    Field("tool_choice", CHAT, HONOURED, "none, auto, required, or a named function; required and named are "
                                         "enforced by a grammar, so the call is valid JSON for its schema"),
    Field("parallel_tool_calls", CHAT, HONOURED, "false: at most one call (generation stops after it)"),
    Field("functions", CHAT, REFUSED, "deprecated by OpenAI; use tools", _set),
    Field("function_call", CHAT, REFUSED, "deprecated by OpenAI; use tool_choice", _set),
    Field("audio", CHAT, REFUSED, "text only", _set),
    Field("modalities", CHAT, PARTLY, "['text'] only", _modalities),
    Field("prediction", CHAT, REFUSED, "no predicted outputs", _set),
    Field("web_search_options", CHAT, REFUSED, "no web search", _set),
    Field("reasoning_effort", CHAT, REFUSED, "use chat_template_kwargs {\"enable_thinking\": false} "
                                             "(or the server's --enable-thinking)", _set),
    Field("verbosity", CHAT, REFUSED, "no verbosity control", _set),
    Field("store", CHAT, PARTLY, "false only: completions are not stored", _true),
    Field("metadata", CHAT, REFUSED, "only meaningful with store", _set),
    Field("service_tier", CHAT, PARTLY, "auto or default (one tier)", _only("auto", "default")),
    Field("prompt_cache_key", CHAT, HONOURED, "accepted; every prompt prefix is cached automatically "
                                              "(radix cache), so no key is needed"),
    Field("prompt_cache_retention", CHAT, PARTLY, "in_memory only", _only("in_memory")),
    Field("safety_identifier", CHAT, HONOURED, "written to the server log with the request id"),
    # OpenAI, completions
    Field("prompt", COMPLETIONS, HONOURED, "text, texts, token ids, or lists of token ids"),
    Field("echo", COMPLETIONS, HONOURED, "the prompt before the completion; with logprobs it is a 400 "
                                         "(no prompt logprobs)"),
    Field("best_of", COMPLETIONS, HONOURED, "best_of >= n candidates, the n with the highest cumulative "
                                            "logprob returned; not with stream"),
    Field("suffix", COMPLETIONS, REFUSED, "no fill-in-the-middle (an empty suffix is accepted)", _true),
    # vLLM / SGLang extensions
    Field("top_k", BOTH, HONOURED, "-1 or 0 off"),
    Field("min_p", BOTH, HONOURED, "[0, 1]"),
    Field("repetition_penalty", BOTH, HONOURED, "> 0, over prompt and output"),
    Field("min_tokens", BOTH, HONOURED, "EOS and stop ids are masked until reached"),
    Field("ignore_eos", BOTH, HONOURED, ""),
    Field("stop_token_ids", BOTH, HONOURED, "ids outside the vocabulary are a 400"),
    Field("include_stop_str_in_output", BOTH, HONOURED, ""),
    Field("skip_special_tokens", BOTH, HONOURED, "default true"),
    Field("spaces_between_special_tokens", BOTH, HONOURED,
          "default false (the fast tokenizer's decoding, as vLLM and SGLang produce with fast tokenizers); "
          "true joins kept special tokens and the text between them with spaces; needs "
          "skip_special_tokens false to show"),
    Field("priority", BOTH, HONOURED, "lower runs first"),
    Field("bootstrap_host", BOTH, HONOURED, "on a decode side (--disaggregation-mode decode): the prefill side "
                                            "that runs the prompt, with bootstrap_port (SGLang's fields)"),
    Field("bootstrap_port", BOTH, HONOURED, "the prefill side's --disaggregation-bootstrap-port"),
    Field("regex", BOTH, HONOURED, "output matches the regex (also guided_regex)"),
    Field("guided_regex", BOTH, HONOURED, "as regex"),
    Field("ebnf", BOTH, HONOURED, "output follows the EBNF grammar (also guided_grammar)"),
    Field("guided_grammar", BOTH, HONOURED, "as ebnf"),
    Field("choice", BOTH, HONOURED, "output is exactly one of the strings (also guided_choice)"),
    Field("guided_choice", BOTH, HONOURED, "as choice"),
    Field("guided_json", BOTH, HONOURED, "a JSON schema, as response_format json_schema"),
    Field("chat_template_kwargs", CHAT, HONOURED, "passed to the template; wins over the server's "
                                                  "--default-chat-template-kwargs and --enable-thinking"),
    Field("add_generation_prompt", CHAT, HONOURED, "default true"),
    Field("separate_reasoning", CHAT, HONOURED, "with --reasoning-parser: <think> text as reasoning_content"),
    Field("use_beam_search", BOTH, REFUSED, "no beam search", _true),
    Field("length_penalty", BOTH, REFUSED, "beam search only", _set),
    Field("prompt_logprobs", BOTH, REFUSED, "no prompt logprobs", _set),
    Field("truncate_prompt_tokens", BOTH, REFUSED, "prompts are never truncated", _set),
    Field("allowed_token_ids", BOTH, REFUSED, "use logit_bias or a grammar", _set),
    Field("bad_words", BOTH, REFUSED, "use logit_bias or a grammar", _set),
    Field("return_tokens_as_token_ids", BOTH, REFUSED, "", _true),
    Field("continue_token_ids", BOTH, HONOURED, "polychip: tokens an earlier attempt generated; the answer "
          "continues them, usage counts them as completion tokens, a seed goes on as if they were drawn (n=1 only)"),
    Field("return_token_ids", BOTH, HONOURED, "polychip: each choice (each chunk) carries its new token ids"),
    Field("structured_outputs", BOTH, REFUSED, "use response_format, regex, ebnf or choice", _set),
    Field("guided_decoding_backend", BOTH, REFUSED, "xgrammar is the one backend", _set),
    Field("guided_whitespace_pattern", BOTH, REFUSED, "", _set),
    Field("structural_tag", BOTH, REFUSED, "", _set),
    Field("lora_path", BOTH, REFUSED, "no LoRA adapters", _set),
    Field("return_hidden_states", BOTH, REFUSED, "", _true),
    Field("continue_final_message", CHAT, REFUSED, "", _true),
    Field("chat_template", CHAT, REFUSED, "the model's own template is used", _set),
    Field("documents", CHAT, REFUSED, "", _set),
    Field("echo", CHAT, REFUSED, "vLLM's chat echo is not served; echo is honoured on completions", _true),
)


Object = dict[str, Any]


class RefusedFields(BaseModel):
    """The fields the table refuses (in full or in part), declared with their OpenAI / vLLM / SGLang
    types so a value is seen, not dropped, and a wrongly typed one is a 400 naming the field before
    any rule reads it."""

    functions: list[Object] | None = None
    function_call: str | Object | None = None
    audio: Object | None = None
    modalities: list[str] | None = None
    prediction: Object | None = None
    web_search_options: Object | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None
    structured_outputs: Object | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | Object | None = None
    lora_path: str | list[str] | None = None
    return_hidden_states: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    documents: list[Object] | None = None
    echo: bool | None = None


def _rules(endpoint: str) -> dict[str, Field]:
    """The row that governs each field on ``endpoint``: its own row, else another endpoint's (so a
    chat-only field sent to completions is still refused, not dropped)."""
    rules: dict[str, Field] = {}
    for f in FIELDS:
        if endpoint in f.endpoints or f.name not in rules:
            rules[f.name] = f
    return rules


RULES = {CHAT: _rules(CHAT), COMPLETIONS: _rules(COMPLETIONS)}


def check_fields(req: BaseModel, endpoint: str) -> None:
    """400 naming the first refused field the request sets."""
    for name, f in RULES[endpoint].items():
        if f.refuse is None or name not in type(req).model_fields:
            continue
        why = f.refuse(getattr(req, name))
        if why:
            raise InvalidRequestError(f"{name} {why} ({f.note})" if f.note else f"{name} {why}")


def log_identity(req: BaseModel, request_id: str) -> None:
    """``user`` and ``safety_identifier`` go to the log (control characters escaped)."""
    for name in ("user", "safety_identifier"):
        value = getattr(req, name, None)
        if value:
            log.info("%s %s=%s", request_id, name, printable(str(value)[:256]))


def markdown() -> str:
    lines = ["# Request fields and their status", "",
             "Generated from `polychip/server/fields.py` (`python -m polychip.server.fields`). Every field is "
             "either honoured or refused with a 400 that names it; fields no OpenAI-compatible server knows "
             "are ignored, as OpenAI's API does.", "",
             "| field | endpoints | status | notes |", "|---|---|---|---|"]
    for f in FIELDS:
        lines.append(f"| `{f.name}` | {f.endpoints} | {f.status} | {f.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
