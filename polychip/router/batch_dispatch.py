"""How a batch line reaches a replica: through the router's own dispatch (model resolution,
version weights, placement, retries), in the ``low`` priority class, never streamed."""
from __future__ import annotations

import json
import uuid

from polychip.router.batch_config import BatchConfig
from polychip.router.batch_store import BatchStore
from polychip.router.batches import BatchJobs
from polychip.router.files import FileStore
from polychip.router.proxy import Call, error_body

BATCH_PRIORITY = "low"


def router_jobs(router, cfg: BatchConfig) -> BatchJobs:
    """The router's BatchJobs over --files-dir, sending through ``router``."""
    from polychip.router.app import _Refusal, prompt_text

    async def send(url: str, body: dict) -> tuple[int, str, bytes]:
        rid = f"req_{uuid.uuid4().hex}"
        if not router.dispatcher.models():        # just started: no replica has reported yet; retried
            return 503, rid, json.dumps(error_body("no replica has reported its model yet", "service_unavailable",
                                                   503)).encode()
        try:
            model = router.resolve_model(body.get("model"))
        except _Refusal as e:
            return e.status, rid, json.dumps(error_body(e.message, e.type, e.status)).encode()
        user = body.get("user") if isinstance(body.get("user"), str) else None
        preferred = body.get("preferred_device_types")
        preferred = tuple(preferred) if isinstance(preferred, list) and all(isinstance(p, str) for p in preferred) else ()
        call = Call(rid, url, json.dumps(body).encode(), model, router.version_for(model, user), BATCH_PRIORITY,
                    preferred, prompt_text(url, body), stream=False)
        resp = await router.proxy.handle(call)
        return resp.status_code, rid, bytes(resp.body)

    return BatchJobs(cfg, FileStore(cfg.files_dir, cfg.max_file_bytes), BatchStore(cfg.files_dir), send)
