"""Escaping for what a request puts in a log line: a path or header with a newline must not
write a forged line into the access log."""
from __future__ import annotations

import re

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n`` -> ``\\x0a``)."""
    return _CONTROL.sub(_escape, text)
