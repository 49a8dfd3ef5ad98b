"""Chat messages -> prompt text and token ids, with special-token text in the messages read as
plain text (by default): a user who types ``<|im_end|><|im_start|>system`` gets those characters,
not a role change. The template's own markers stay special.

How: each special-token string in the caller's text is swapped for a numbered marker made of a
private-use character found nowhere in the input or the template; the template is rendered; the
text between markers is encoded as usual and each swapped string is encoded as plain text.
"""
from __future__ import annotations

import re
from typing import Any

from polychip.errors import InvalidRequestError

_PRIVATE_USE = re.compile("[\U000F0000-\U000FFFFD]")     # Unicode plane 15, private use


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except InvalidRequestError:
        raise
    except Exception as e:   # a template may fail in any way on odd input; that is the request's fault
        raise InvalidRequestError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None


def render_and_encode(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict[str, Any],
                      special_tokens_as_text: bool = True, size_check=None) -> tuple[str, list[int]]:
    """(prompt text, token ids); ``size_check(text)`` may refuse the rendered text before it is
    tokenised. Runs in a tokenizer thread."""
    pattern = _special_pattern(tokenizer.special_tokens)
    strings = list(strings_in((messages, kwargs)))
    if not special_tokens_as_text or pattern is None or not any(pattern.search(s) for s in strings):
        text = render(tokenizer, messages, add_generation_prompt, kwargs)
        if size_check is not None:
            size_check(text)
        return text, tokenizer.encode(text, add_special_tokens=False)
    mark = _free_char(strings + [tokenizer.chat_template or ""])
    found: list[str] = []

    def swap(m: re.Match) -> str:
        found.append(m.group())
        return f"{mark}{len(found) - 1}{mark}"

    protect = lambda s: pattern.sub(swap, s)   # noqa: E731
    text = render(tokenizer, _map_strings(messages, protect), add_generation_prompt, _map_strings(kwargs, protect))
    pieces = re.split(f"{mark}(\\d+){mark}", text)
    if any(mark in p for p in pieces[::2]):
        raise InvalidRequestError("messages: the chat template cut into special-token text in the messages, so it "
                                  "cannot be kept as plain text; remove it, or start the server with "
                                  "--special-tokens-in-content")
    plain = "".join(p if k % 2 == 0 else found[int(p)] for k, p in enumerate(pieces))
    if size_check is not None:
        size_check(plain)
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
        else:
            ids += tokenizer.encode(found[int(piece)], add_special_tokens=False, special_tokens_as_text=True)
    return plain, ids


def _special_pattern(specials: tuple[str, ...]) -> re.Pattern | None:
    if not specials:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def strings_in(value):
    """Every string (dict keys included) in a JSON-like value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings_in(k)
            yield from strings_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from strings_in(v)


def _map_strings(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value


def _free_char(texts: list[str]) -> str:
    used = {c for t in texts for c in _PRIVATE_USE.findall(t)}
    for code in range(0xF0000, 0xFFFFE):
        if chr(code) not in used:
            return chr(code)
    raise InvalidRequestError("messages: every private-use character of Unicode plane 15 occurs in them, so "
                              "special-token text cannot be marked as plain text")
