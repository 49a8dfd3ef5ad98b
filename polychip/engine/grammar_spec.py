"""GrammarSpec: a structured-output constraint as a request carries it (a frozen value; no torch).
Compiling and applying it is ``engine/grammar.py``'s."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from polychip.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag")
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: ")     # "[15:38:02] /project/cpp/x.cc:94: "


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output. ``source`` is the canonical text the cache is keyed by: the
    schema as JSON, the regex, the EBNF, the choices as a JSON list, or a structural tag as JSON.
    ``param`` names the request field it came from, for error messages. JSON schemas compile in
    xgrammar's strict mode: no properties or items beyond those the schema lists."""

    kind: str
    source: str = ""
    param: str = field(default="", compare=False)
    compiled: object = field(default=None, compare=False, repr=False)   # set by compiled(): no engine-thread work

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"grammar kind must be one of {list(KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str = "json_schema") -> "GrammarSpec":
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{param} must be a JSON object (a JSON schema), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema), param)   # key order is output order

    @classmethod
    def tool_calls(cls, fmt: str, tools: list[dict], tool_choice, parallel: bool, reasoning: str) -> "GrammarSpec":
        """Calls in ``fmt`` (an xgrammar structural-tag model, e.g. "qwen_3") that must happen:
        ``tool_choice`` "required" or a named function. Imports xgrammar: call it off the loop."""
        import xgrammar
        try:
            tag = xgrammar.get_model_structural_tag(fmt, tools=tools, tool_choice=tool_choice, reasoning=reasoning,
                                                    parallel_tool_calls=parallel, max_whitespace_cnt=1)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"tool_choice: {clean_message(e)}") from None
        return cls("structural_tag", tag.model_dump_json(), "tool_choice")

    @classmethod
    def choice(cls, choices: list[str], param: str = "choice") -> "GrammarSpec":
        if not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidRequestError(f"{param} must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices)), param)


def clean_message(err: Exception) -> str:
    return _XGR_PREFIX.sub("", str(err)).strip().splitlines()[0] if str(err).strip() else type(err).__name__
