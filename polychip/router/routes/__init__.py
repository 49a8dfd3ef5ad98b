"""The router's routes, one APIRouter per concern: ``openai_api`` (the client API), ``probes``
(/health, /metrics: no key) and ``admin`` (replicas, rollout, reload). Each handler finds the
Router on ``request.app.state.router``; ``requires_key`` is the edge's API-key dependency
reading the key the router holds now (a reload may change it)."""
from __future__ import annotations

from fastapi import Depends, Request

from polychip.http.auth import require_api_key


def router_of(request: Request):
    return request.app.state.router


requires_key = Depends(require_api_key(lambda request: router_of(request).cfg.api_key))
