"""Reasoning parsers: split ``<think>...</think>`` text from the answer, streaming or not.

The same incremental parser serves both paths, so a streamed reply concatenates to
exactly the non-streamed one.
"""
from __future__ import annotations

START, END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Qwen3ReasoningParser:
    """Qwen3: the reply may open with ``<think>``; when the prompt already ends inside an open
    think block (templates that pre-fill ``<think>``), the reply starts as reasoning."""

    def __init__(self, prompt_text: str = ""):
        tail = prompt_text.rstrip()
        self.state = "reasoning" if tail.endswith(START) else "start"
        self.buf = ""
        self.at_segment_start = True      # drop whitespace right after <think> / </think>

    def feed(self, delta: str) -> tuple[str, str]:
        """Consume a text delta; return (reasoning delta, content delta) ready to send."""
        self.buf += delta
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf = head[len(START):]
                    self.state, self.at_segment_start = "reasoning", True
                    continue
                if START.startswith(head):       # still could become <think>
                    return reasoning, content
                self.state, self.at_segment_start = "content", False
                continue
            if self.state == "reasoning":
                if self.at_segment_start:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        return reasoning, content
                    self.at_segment_start = False
                i = self.buf.find(END)
                if i >= 0:
                    reasoning += self.buf[:i].rstrip()
                    self.buf = self.buf[i + len(END):]
                    self.state, self.at_segment_start = "content", True
                    continue
                # hold back a possible partial </think> and trailing whitespace before it
                hold = _partial_suffix(self.buf, END)
                body = self.buf[:len(self.buf) - hold]
                keep = len(body) - len(body.rstrip())
                cut = len(self.buf) - hold - keep
                reasoning += self.buf[:cut]
                self.buf = self.buf[cut:]
                return reasoning, content
            # content
            if self.at_segment_start:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return reasoning, content
                self.at_segment_start = False
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush at the end of the reply: an unclosed think block is all reasoning."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest.rstrip(), ""
        return "", rest


def parse_reasoning(prompt_text: str, text: str) -> tuple[str, str]:
    """Whole reply -> (reasoning_content, content)."""
    p = Qwen3ReasoningParser(prompt_text)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return r1 + r2, c1 + c2


PARSERS = {"qwen3": Qwen3ReasoningParser}
