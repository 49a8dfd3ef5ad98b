"""Tools on /v1/chat/completions: checking ``tools`` and ``tool_choice``, rendering earlier calls and
results through the chat template, the plan for one request (parser, call limit, grammar), and
the reply parser that turns a reply into reasoning, content and tool calls, streamed or not.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

from polychip.engine.grammar_spec import GrammarSpec
from polychip.errors import InvalidRequestError
from polychip.server.tool_parsers import PARSERS, ToolCall, detect_parser

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")      # OpenAI's function-name rule (dots as vLLM allows)


def check_tools(tools: list[dict]) -> None:
    """OpenAI's shape: ``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``."""
    names = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise InvalidRequestError(f"{where}.type must be 'function' (the only tool type served)")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', "
                                      f"got {name!r}")
        if name in names:
            raise InvalidRequestError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object")
        if "description" in fn and not isinstance(fn["description"], str):
            raise InvalidRequestError(f"{where}.function.description must be a string")


def normalise_choice(choice, tools: list[dict] | None):
    """"none" | "auto" | "required" | the named function's name (a str in a 1-tuple)."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        known = [t["function"]["name"] for t in tools or []]
        if name not in known:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools {known}")
        return (name,)
    raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}")


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant ``tool_calls`` carry their arguments as a JSON string (OpenAI's shape); templates
    write ``arguments | tojson``, so they get the object."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            if not isinstance(calls, list):
                raise InvalidRequestError(f"messages[{i}].tool_calls must be a list")
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidRequestError(f"messages[{i}].tool_calls[{j}] needs function.name")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args or "{}")
                    except json.JSONDecodeError as e:
                        raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                                  f"valid JSON: {e.msg}") from None
                fixed.append({**c, "function": {**fn, "arguments": args}})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


@dataclass
class ToolPlan:
    """What one request's tools mean for generation and for reading the reply."""

    parser_cls: type | None               # None: tool_choice "none" (the reply is all content)
    max_calls: int | None = None          # parallel_tool_calls=false: 1
    stop: list[str] = field(default_factory=list)
    forced: tuple | None = None           # (tools, tool_choice, parallel, reasoning) for the grammar

    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar that guarantees a valid call (required / named). Imports xgrammar."""
        if self.forced is None:
            return None
        tools, choice, parallel, reasoning = self.forced
        return GrammarSpec.tool_calls(self.parser_cls.structural_tag_model, tools, choice, parallel, reasoning)


def plan_tools(tools: list[dict] | None, choice, parallel: bool, parser_name: str | None,
               chat_template: str | None, prompt_text: str) -> ToolPlan | None:
    """None when the request has no tools."""
    if tools is not None:
        check_tools(tools)
    kind = normalise_choice(choice, tools)
    if not tools:
        return None
    if chat_template is not None and "tools" not in chat_template:
        raise InvalidRequestError("tools: this model's chat template does not render tools, so the model would "
                                  "never see them; describe them in a message instead")
    if kind == "none":
        return ToolPlan(None)
    name = parser_name or detect_parser(chat_template)
    if name is None:
        raise InvalidRequestError("tools: this model's chat template shows no tool-call format the server can "
                                  "parse; start it with --tool-call-parser, or send tool_choice 'none'")
    plan = ToolPlan(PARSERS[name], None if parallel else 1)
    if kind == "auto":
        if not parallel:                 # stop after the first call instead of cutting the others off
            plan.stop = [plan.parser_cls.END]
        return plan
    xgr_choice = "required" if kind == "required" else {"type": "function", "function": {"name": kind[0]}}
    plan.forced = (tools, xgr_choice, parallel, _reasoning_mode(chat_template, prompt_text))
    return plan


def _reasoning_mode(chat_template: str | None, prompt_text: str) -> str:
    """A thinking model may open with a <think> block unless the prompt already closed it."""
    if not chat_template or "<think>" not in chat_template or prompt_text.rstrip().endswith("</think>"):
        return "disabled"
    return "auto"


async def request_grammar(grammar, spec: GrammarSpec | None, plan: ToolPlan | None) -> GrammarSpec | None:
    """The request's one grammar, compiled off the event loop: its structured-output field, or
    the forced tool call."""
    if plan is not None and plan.forced is not None:
        if spec is not None:
            raise InvalidRequestError(f"tool_choice {plan.forced[1]!r} already constrains the output; "
                                      f"it cannot be combined with {spec.param}")
        return await asyncio.to_thread(lambda: grammar.compiled(plan.grammar_spec()))
    if spec is None:
        return None
    return await asyncio.to_thread(grammar.compiled, spec)


class ReplyParser:
    """Reply text -> deltas with ``reasoning_content``, ``content`` and ``tool_calls``; the reasoning
    parser runs first, the tool parser reads what it calls content."""

    def __init__(self, reasoning, plan: ToolPlan | None):
        self.reasoning = reasoning                      # a reasoning parser or None
        self.tools = plan.parser_cls(plan.max_calls) if plan is not None and plan.parser_cls else None
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> dict:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                r2, c2 = self.reasoning.finish()
                reasoning, content = reasoning + r2, content + c2
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                c2, t2 = self.tools.finish()
                content, calls = content + c2, calls + t2
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            base = len(self.calls)
            delta["tool_calls"] = [{"index": base + k, **c.to_openai()} for k, c in enumerate(calls)]
            self.calls.extend(calls)
        return delta

    def message(self, text: str) -> dict:
        """The whole reply as a chat message."""
        d = self.feed(text, final=True)
        msg = {"role": "assistant", "content": d.get("content", "" if not self.calls else None)}
        if self.reasoning is not None:
            msg["reasoning_content"] = d.get("reasoning_content")
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason
