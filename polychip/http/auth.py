"""The API-key check, in one place: the Gate uses it for every path but the open ones, and the
router's routes use ``require_api_key`` as a FastAPI dependency (the key can change on reload)."""
from __future__ import annotations

import hmac
from typing import Callable

from fastapi import Request

from polychip.http.errors import APIError


def bearer_token(authorization: str, x_api_key: str) -> str:
    """The key a client sent: ``Authorization: Bearer <key>``, else ``X-Api-Key``."""
    return authorization[7:].strip() if authorization[:7].lower() == "bearer " else x_api_key


def key_refusal(token: str, key: str | None) -> APIError | None:
    """None when no key is set or ``token`` is it (compared in constant time); else the 401."""
    if key is None or (token and hmac.compare_digest(token.encode(), key.encode())):
        return None
    why = "missing API key" if not token else "invalid API key"
    return APIError(401, f"{why}: send 'Authorization: Bearer <key>'", "authentication_error", None,
                    "invalid_api_key", {"www-authenticate": "Bearer"})


def require_api_key(key_of: Callable[[Request], str | None]):
    """A FastAPI dependency: raises the 401 unless the request carries ``key_of(request)``."""
    async def check(request: Request) -> None:
        token = bearer_token(request.headers.get("authorization", ""), request.headers.get("x-api-key", ""))
        refusal = key_refusal(token, key_of(request))
        if refusal is not None:
            raise refusal
    return check
