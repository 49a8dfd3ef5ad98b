"""One input line of an OpenAI batch file: ``{custom_id, method, url, body}``. Here: its shape,
its url, a body that is an object and does not stream, duplicate custom_ids. Whether the endpoint
would take the body is the server's to say (``server/batch_check.py``): ``polychip batch`` calls it
in-process, the router asks a replica (``POST /batch_check``), both through ``check_body``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from polychip.http.errors import validation_message

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# (url, body) -> (message, param) when the endpoint would refuse the body, else None
CheckBody = Callable[[str, dict], "tuple[str, str | None] | None"]
MAX_CUSTOM_ID = 512
MAX_LISTED_ERRORS = 100      # a refused file lists this many problems (and counts the rest)


class _Line(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    custom_id: StrictStr = Field(min_length=1, max_length=MAX_CUSTOM_ID)
    method: Literal["POST"]
    url: StrictStr
    body: dict


class _IdOnly(BaseModel):
    custom_id: StrictStr | None = None


@dataclass(frozen=True)
class BatchRequest:
    line: int            # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None      # None when the line is too broken to name one
    code: str                  # invalid_json | invalid_line | invalid_url | invalid_body | duplicate_custom_id
    message: str
    param: str | None = None

    def describe(self) -> str:
        return f"line {self.line}: {self.message}"


def parse_line(raw: bytes, line: int, check_body: CheckBody | None = None) -> BatchRequest | LineError:
    """The request on ``raw`` (one line, without its newline), or why it is refused."""
    try:
        parsed = _Line.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            detail = validation_message(errors)[0].replace("invalid JSON body", "invalid JSON", 1)
            return LineError(line, None, "invalid_json", detail)
        msg, param = validation_message(errors)
        return LineError(line, _custom_id(raw), "invalid_line", msg, param)
    if parsed.url not in ENDPOINTS:
        return LineError(line, parsed.custom_id, "invalid_url", f"url {parsed.url!r} is not a batch endpoint; "
                         f"expected one of {list(ENDPOINTS)}", "url")
    if parsed.body.get("stream"):
        return LineError(line, parsed.custom_id, "invalid_body", "body: stream must be false in a batch (each "
                         "answer is one output line)", "stream")
    why = check_body(parsed.url, parsed.body) if check_body is not None else None
    if why is not None:
        return body_error(line, parsed.custom_id, why)
    return BatchRequest(line, parsed.custom_id, parsed.url, parsed.body)


def body_error(line: int, custom_id: str, why: tuple[str, str | None]) -> LineError:
    return LineError(line, custom_id, "invalid_body", f"body: {why[0]}", why[1])


def _custom_id(raw: bytes) -> str | None:
    try:
        return _IdOnly.model_validate_json(raw).custom_id
    except ValidationError:
        return None


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of every non-blank line, streamed (blank lines keep their numbers)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            raw = raw.strip()
            if raw:
                yield number, raw


def parsed_lines(path: str, check_body: CheckBody | None = None) -> Iterator[BatchRequest | LineError]:
    for number, raw in read_lines(path):
        yield parse_line(raw, number, check_body)


@dataclass
class FileCheck:
    """What one streaming pass over a batch file found."""
    total: int = 0                 # non-blank lines
    errors: list[LineError] = field(default_factory=list)     # the first MAX_LISTED_ERRORS
    error_count: int = 0
    duplicates: int = 0

    def add(self, err: LineError) -> None:
        self.error_count += 1
        self.duplicates += err.code == "duplicate_custom_id"
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append(err)

    def summary(self, limit: int = 5) -> str:
        shown = "; ".join(e.describe() for e in self.errors[:limit])
        more = self.error_count - min(limit, len(self.errors))
        return shown + (f"; and {more} more" if more > 0 else "")


def check_file(path: str, endpoint: str | None = None, check_body: CheckBody | None = None) -> FileCheck:
    """Stream the file once: count its lines, check each, and find duplicate custom_ids (each
    repeat names the line that used the id first); with ``endpoint``, every line's url must be it
    (a batch runs one endpoint). Memory: the set of ids, not the lines."""
    seen: dict[str, int] = {}
    found = FileCheck()
    for item in parsed_lines(path, check_body):
        found.total += 1
        if isinstance(item, LineError):
            found.add(item)
        elif endpoint is not None and item.url != endpoint:
            found.add(LineError(item.line, item.custom_id, "mismatched_url", f"url {item.url!r} is not the "
                                f"batch's endpoint {endpoint!r}", "url"))
        cid = item.custom_id
        if cid is None:
            continue
        if cid in seen:
            found.add(LineError(item.line, cid, "duplicate_custom_id", f"custom_id {cid!r} is used again "
                                f"(first on line {seen[cid]}); every custom_id must be unique", "custom_id"))
        else:
            seen[cid] = item.line
    return found
