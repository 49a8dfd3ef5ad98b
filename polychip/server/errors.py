"""The server's errors on top of the edge's (``polychip/http/errors.py``): a refused request
(InvalidRequestError) is a 400 naming its parameter, an overloaded or dead engine a 503."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from polychip.engine.async_engine import EngineDeadError, EngineOverloadedError
from polychip.errors import InvalidRequestError, KVTransferError, PolychipError
from polychip.http.errors import APIError, base_response, error_response

_PARAM = re.compile(r"^([a-z_][a-z0-9_]*)\b")

__all__ = ["APIError", "message_of", "param_of", "to_response"]


def message_of(err: Exception) -> str:
    """The message without the ``[layer]`` prefix a PolychipError prints."""
    return err.args[0] if isinstance(err, PolychipError) and err.args else str(err)


def param_of(message: str, known: frozenset[str]) -> str | None:
    """SamplingParams and friends start messages with the parameter name."""
    m = _PARAM.match(message)
    return m.group(1) if m and m.group(1) in known else None


def to_response(err: Exception, known_params: frozenset[str] = frozenset()) -> JSONResponse:
    if isinstance(err, InvalidRequestError):
        msg = message_of(err)
        return error_response(400, msg, "invalid_request_error", param_of(msg, known_params))
    if isinstance(err, EngineOverloadedError):
        return error_response(503, message_of(err), "server_overloaded", headers={"Retry-After": "1"})
    if isinstance(err, KVTransferError):    # a decode side that cannot reserve pages now: try another
        return error_response(503, message_of(err), "server_overloaded", headers={"Retry-After": "1"})
    if isinstance(err, EngineDeadError):
        return error_response(503, message_of(err), "service_unavailable")
    return base_response(err)
