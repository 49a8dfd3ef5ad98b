"""Tool-call parsers: a model's reply text -> (content, OpenAI tool calls), streaming or not.

One incremental parser serves both paths, so a streamed reply adds up to exactly the
non-streamed one. The Hermes format of the Qwen2.5 / Qwen3 templates is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any number of blocks, text around them. A block whose JSON does not parse into a name and an
object of arguments stays in the content as it was written (nothing is dropped).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from polychip.server.reasoning import _partial_suffix


@dataclass
class ToolCall:
    name: str
    arguments: str                 # a JSON object, as a string (OpenAI's shape)
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes)."""

    START, END = "<tool_call>", "</tool_call>"
    structural_tag_model = "qwen_3"          # xgrammar's builder for exactly this format

    def __init__(self, max_calls: int | None = None):
        self.buf = ""
        self.in_call = False
        self.pending_ws = ""                 # trailing whitespace, held: dropped if a call follows
        self.after_call = False              # the whitespace right after a call opens no content
        self.emitted = False
        self.max_calls = max_calls           # parallel_tool_calls=false: 1
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Consume a text delta; return (content delta, tool calls completed by it)."""
        self.buf += delta
        content, done = "", []
        while True:
            if self.in_call:
                i = self.buf.find(self.END)
                if i < 0:
                    return content, done
                body, self.buf = self.buf[:i], self.buf[i + len(self.END):]
                self.in_call = False
                call = self._parse(body)
                if call is None:
                    content += self._text(self.START + body + self.END)
                else:
                    done.append(call)
                    self.after_call = True
                continue
            i = self.buf.find(self.START)
            if i >= 0:
                content += self._text(self.buf[:i], call_follows=True)
                self.buf = self.buf[i + len(self.START):]
                self.in_call = True
                continue
            hold = _partial_suffix(self.buf, self.START)
            cut = len(self.buf) - hold
            content += self._text(self.buf[:cut])
            self.buf = self.buf[cut:]
            return content, done

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of the reply: an unclosed block counts if its JSON is complete, else it is text.
        A reply without calls comes out exactly as written; around calls, whitespace goes."""
        rest, self.buf = self.buf, ""
        if self.in_call:
            self.in_call = False
            call = self._parse(rest)
            if call is not None:
                return "", [call]
            rest = self.START + rest
        out = self._text(rest)
        if not self.calls:
            out, self.pending_ws = out + self.pending_ws, ""
        return out, []

    def _text(self, text: str, call_follows: bool = False) -> str:
        """The content to send for ``text``: held whitespace first, trailing whitespace held back."""
        if self.after_call and not self.emitted:
            text = text.lstrip()
            if not text:
                return ""
        self.after_call = False
        text = self.pending_ws + text
        body = text.rstrip()
        self.pending_ws = "" if call_follows else text[len(body):]
        self.emitted = self.emitted or bool(body)
        return body

    def _parse(self, body: str) -> ToolCall | None:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return None
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):          # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        call = ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        return call


def parse_tool_calls(parser_cls, text: str, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """Whole reply -> (content, tool calls)."""
    p = parser_cls(max_calls)
    c1, t1 = p.feed(text)
    c2, t2 = p.finish()
    return c1 + c2, t1 + t2


PARSERS = {"qwen25": HermesToolParser, "qwen": HermesToolParser}


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template implies: Hermes-style templates teach the model <tool_call>."""
    if chat_template and HermesToolParser.START in chat_template:
        return "qwen25"
    return None
