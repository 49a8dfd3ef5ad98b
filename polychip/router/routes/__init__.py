"""The router's routes, one APIRouter per concern, each made by a function given only the parts it
uses (app.py, the composition root, hands them over): ``openai_api`` (the client API), ``probes``
(/health, /metrics: no key), ``admin`` (replicas, rollout, state, reload), ``workloads`` (workloads
and devices) and ``batches`` (files and batch jobs). ``requires_key`` is the edge's API-key
dependency reading the key in force now (a reload may change it)."""
from __future__ import annotations

from fastapi import Depends

from polychip.http.auth import require_api_key


def requires_key(settings):
    """The API-key dependency over the settings in force (a LiveSettings)."""
    return Depends(require_api_key(lambda request: settings.now.api_key))
