"""Tokenizer from a HF folder (tokenizer.json + tokenizer_config.json), chat templates
rendered with jinja2 as transformers does, and incremental detokenisation."""
from __future__ import annotations

import json
import os
import unicodedata
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from polychip.errors import InvalidRequestError, ModelLoadError


def _token_str(v):
    return v.get("content") if isinstance(v, dict) else v


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


_UNICODE_FORMS = frozenset({"NFC", "NFKC", "NFD", "NFKD"})


def _normal_forms(normalizer) -> tuple[str, ...] | None:
    """The Unicode normal forms a normaliser applies, in order, when that is all it does that can
    shorten text (Prepend only adds); None for any other normaliser."""
    if normalizer is None:
        return ()
    state = json.loads(normalizer.__getstate__())
    kinds = [n["type"] for n in state.get("normalizers", [state])]
    if not set(kinds) <= _UNICODE_FORMS | {"Prepend"}:
        return None
    return tuple(k for k in kinds if k in _UNICODE_FORMS)


def check_utf8(text: str) -> None:
    """Text with lone surrogates (e.g. from a JSON ``\\ud800`` escape) has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"text is not valid UTF-8: {e.reason} (U+{ord(text[e.start]):04X}) at "
                                  f"character {e.start}") from None


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict, eos_token_ids: tuple[int, ...] = ()):
        self.tok = tok
        self.config = config
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"),
                                      self.chat_template[0]["template"])
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        ids = set(eos_token_ids)
        if self.eos_token and tok.token_to_id(self.eos_token) is not None:
            ids.add(tok.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(ids)
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self.special_tokens = tuple(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
        self._template = None
        self._plain = None                    # a copy that reads special-token text as plain text
        self._forms = _normal_forms(tok.normalizer)
        self._longest: int | None = None       # characters of the longest vocabulary entry

    @classmethod
    def from_dir(cls, path: str, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise ModelLoadError(f"{path}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(tj)
        except Exception as e:  # the tokenizers library raises plain Exception on bad files
            raise ModelLoadError(f"{tj}: cannot parse tokenizer ({e})") from None
        config = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(tc):
            with open(tc, encoding="utf-8") as f:
                config = json.load(f)
        jt = os.path.join(path, "chat_template.jinja")
        if "chat_template" not in config and os.path.exists(jt):
            with open(jt, encoding="utf-8") as f:
                config["chat_template"] = f.read()
        return cls(tok, config, eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True, special_tokens_as_text: bool = False) -> list[int]:
        """Token ids of ``text``. ``special_tokens_as_text`` reads e.g. ``<|im_end|>`` as the plain
        characters, not the control token. Refuses text that is not valid UTF-8."""
        check_utf8(text)
        tok = self._plain_tokenizer() if special_tokens_as_text else self.tok
        # encode_batch releases the GIL while the Rust side works (encode does not), so a long
        # text tokenised in a worker thread does not stall the event loop or the engine thread
        ids = tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def _plain_tokenizer(self) -> HFTokenizer:
        if self._plain is None:
            plain = HFTokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def min_tokens(self, text: str) -> int | None:
        """A lower bound on ``len(encode(text))`` without tokenising: no token covers more input
        than the longest vocabulary entry (a byte-level entry has one character per byte). None when
        the normaliser may drop text, so no such bound exists. Costs O(1) for ASCII text."""
        if self._forms is None:
            return None
        if self._longest is None:
            self._longest = max(map(len, self.tok.get_vocab(with_added_tokens=True)))
        n = len(text)
        if self._forms and not text.isascii():          # normal forms leave ASCII as it is
            for form in self._forms:
                text = unicodedata.normalize(form, text)
            n = len(text)
        return -(-n // self._longest)

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = False) -> str:
        """``spaces_between_special_tokens`` (kept special tokens only): special tokens and the
        text runs between them are joined with a space, as transformers' slow tokenizers do."""
        if skip_special_tokens or not spaces_between_special_tokens or not self.special_ids.intersection(ids):
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for i in ids:
            if i in self.special_ids:
                if run:
                    parts.append(self.tok.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self.tok.decode([i], skip_special_tokens=False))
            else:
                run.append(i)
        if run:
            parts.append(self.tok.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use a plain completion prompt")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}") from None


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a multi-byte character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = False):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        # kept special tokens and the text next to them joined by a space, as decode() does
        self.spaces = spaces_between_special_tokens and not skip_special_tokens
        self.ids = list(prompt_ids[-6:])      # a little context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.last_special = False
        self.space_due = False                # a space owed before the next piece of text

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        if self.spaces:
            special = token_id in self.tokenizer.special_ids
            self.space_due = self.space_due or (bool(self.text) and (special or self.last_special))
            self.last_special = special
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = dec(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        if self.space_due:
            delta, self.space_due = " " + delta, False
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
