"""Every failure at the edge becomes an OpenAI-style error body: {"error": {message, type, param, code}}.

The server and the router install the same handlers (``install_error_handlers``); each passes
its own ``to_response`` for the errors only it knows (the server's engine faults), falling back
to ``base_response``.
"""
from __future__ import annotations

import logging
import re
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from polychip.errors import PolychipError

log = logging.getLogger("polychip.http")


class APIError(Exception):
    """An error with an explicit HTTP status (model not found, auth, ...)."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers


def error_body(message: str, type_: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code if code is not None else status),
                        status_code=status, headers=headers)


def base_response(err: Exception) -> JSONResponse:
    """An APIError as it says; anything else is a logged 500 that names only the error's type."""
    if isinstance(err, APIError):
        return error_response(err.status, err.message, err.type, err.param, err.code, err.headers)
    log.error("internal error: %r", err, exc_info=err)
    return error_response(500, f"internal error: {type(err).__name__}", "internal_error")


_TYPE_TAG = re.compile(r"^(str|int|float|bool|[A-Za-z_]+\[.*\]|[A-Z][A-Za-z]+)$")


# what pydantic's JSON parser says -> the cause in words a client can act on
_JSON_CAUSES = (
    ("recursion limit", "it is nested too deeply"),
    ("number out of range", "a number has too many digits"),
    ("surrogate", "a \\uD800-\\uDFFF escape is not part of a surrogate pair, so it is not text"),
    ("hex escape", "a \\uD800-\\uDFFF escape is not part of a surrogate pair, so it is not text"),
    ("invalid unicode code point", "it is not valid UTF-8"),
)


def json_error_message(detail: str) -> str:
    cause = next((why for key, why in _JSON_CAUSES if key in detail), None)
    return f"invalid JSON body: {detail}" + (f" ({cause})" if cause else "")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic errors; a union mismatch names the accepted types."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return json_error_message(str(first.get("ctx", {}).get("error", "cannot parse"))), None
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if not loc and first.get("type") in ("missing", "model_type", "model_attributes_type", "dict_type"):
        return "the body must be a JSON object", None
    cut = next((i for i, x in enumerate(loc) if isinstance(x, str) and i > 0 and _TYPE_TAG.match(x)), None)
    if cut is not None:
        prefix = loc[:cut]
        tags = list(dict.fromkeys(e["loc"][len(prefix)] for e in errors
                                  if list(e["loc"][:cut]) == prefix and len(e["loc"]) > cut))
        where = ".".join(map(str, prefix))
        return f"{where}: invalid value; expected one of: {', '.join(map(str, tags))}", str(loc[0])
    where = ".".join(map(str, loc)) or "body"
    return f"{where}: {first.get('msg', 'invalid value')}", (str(loc[0]) if loc else None)


def parse_body(raw: bytes, model: type[BaseModel]):
    """The request model from a JSON body, or a 400 APIError naming the cause. pydantic's own JSON
    parser reads the bytes: its depth, number-size and UTF-8 limits turn every malformed body into a
    validation error, where the standard library raised RecursionError or ValueError."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        msg, param = validation_message(e.errors())
        raise APIError(400, msg, "invalid_request_error", param) from None


def install_error_handlers(app: FastAPI, to_response: Callable[[Exception], JSONResponse] = base_response) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = validation_message(list(exc.errors()))
        return error_response(400, msg, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    for cls in (APIError, PolychipError, Exception):
        app.add_exception_handler(cls, lambda request, exc: to_response(exc))
