"""Structured-output request fields -> one GrammarSpec, compiled off the event loop.

OpenAI's ``response_format`` (text, json_object, json_schema strict or not) and the vLLM / SGLang
extensions ``regex``, ``ebnf``, ``choice`` and their ``guided_*`` spellings. At most one per request.

A schema is enforced whether ``strict`` is true or false (the token mask guarantees it either way),
and, as vLLM and SGLang do, properties the schema does not list are not generated: JSON Schema
would allow them by default, and a model left free to add keys may add them until max_tokens.
"""
from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

from polychip.engine.grammar_spec import GrammarSpec
from polychip.errors import InvalidRequestError


class StructuredFields(BaseModel):
    """Mixed into the chat and completion request models."""

    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    guided_json: dict[str, Any] | str | None = None

    def grammar_spec(self) -> GrammarSpec | None:
        specs = [s for s in (self._from_response_format(), *self._from_extensions()) if s is not None]
        if len(specs) > 1:
            raise InvalidRequestError(f"{specs[0].param} and {specs[1].param} both constrain the output; "
                                      "send one of response_format, regex, ebnf, choice")
        return specs[0] if specs else None

    def _from_response_format(self) -> GrammarSpec | None:
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return GrammarSpec("json_object", param="response_format")
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise InvalidRequestError("response_format.json_schema must be an object with a schema")
            schema = js.get("schema", js.get("schema_"))
            if schema is None:
                raise InvalidRequestError("response_format.json_schema.schema is missing")
            strict = js.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise InvalidRequestError("response_format.json_schema.strict must be a boolean")
            return GrammarSpec.json_schema(schema, "response_format.json_schema.schema")
        raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                                  f"got {kind!r}")

    def _from_extensions(self) -> list[GrammarSpec | None]:
        out: list[GrammarSpec | None] = []
        for name in ("regex", "guided_regex"):
            if getattr(self, name) is not None:
                out.append(GrammarSpec("regex", getattr(self, name), param=name))
        for name in ("ebnf", "guided_grammar"):
            if getattr(self, name) is not None:
                out.append(GrammarSpec("ebnf", getattr(self, name), param=name))
        for name in ("choice", "guided_choice"):
            if getattr(self, name) is not None:
                out.append(GrammarSpec.choice(getattr(self, name), name))
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                import json
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"guided_json is not valid JSON: {e.msg}") from None
            out.append(GrammarSpec.json_schema(schema, "guided_json"))
        return out


async def compile_off_loop(grammar, spec: GrammarSpec | None) -> GrammarSpec | None:
    """Compile in a worker thread (xgrammar caches per spec), so neither the event loop nor the
    engine thread waits for it. Raises InvalidRequestError naming the field on a bad spec."""
    if spec is None:
        return None
    return await asyncio.to_thread(grammar.compiled, spec)
