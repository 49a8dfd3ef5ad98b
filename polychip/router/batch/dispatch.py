"""How a batch reaches the replicas: its bodies are checked by a replica's ``POST /batch_check``
(the server owns what it refuses), and each line goes through the router's own dispatch (model
resolution, version weights, placement, retries) in the ``low`` priority class, never streamed.
Batch objects live in the router's state store; only the state's leader runs them."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid

from polychip.http.errors import APIError, error_body
from polychip.router.batch.files import FileStore
from polychip.router.batch.jobs import BatchJobs
from polychip.router.batch.store import BatchStore
from polychip.router.routing.call import Call
from polychip.router.routing.request import RoutedBody, prompt_text, resolve_model
from polychip.router.settings import BatchConfig
from polychip.router.state import default_state_dir

log = logging.getLogger("polychip.router.batch")

BATCH_PRIORITY = "low"


def router_jobs(cfg: BatchConfig, dispatcher, rollout, handle, client, state, spawn=None,
                files_dir: str | None = None) -> BatchJobs:
    """The router's BatchJobs over ``files_dir`` (--files-dir, or the one beside the embedded state): lines go through ``handle(call)`` (the proxy) as the
    dispatcher and the rollout place them; bodies are checked by an up worker of ``dispatcher.registry``
    through ``client`` (the ReplicaClient); ``state`` (RouterState) keeps the batch objects and elects
    the runner; ``spawn``: the task supervisor's, for the runs."""

    async def send(url: str, body: dict) -> tuple[int, str, bytes]:
        rid = f"req_{uuid.uuid4().hex}"
        try:
            routed = RoutedBody.model_validate(body)
            known = dispatcher.models()
            if not known:                 # just started: no replica has reported yet (503: retried)
                raise APIError(503, "no replica has reported its model yet", "service_unavailable")
            model = resolve_model(known, routed.model)
        except APIError as e:
            return e.status, rid, json.dumps(error_body(e.message, e.type, e.param, e.status)).encode()
        user = routed.user if isinstance(routed.user, str) else None
        call = Call(rid, url, json.dumps(body).encode(), model, rollout.version_for(model, user), BATCH_PRIORITY,
                    tuple(routed.preferred_device_types or ()), prompt_text(url, routed), stream=False)
        resp = await handle(call)
        return resp.status_code, rid, bytes(resp.body)

    async def check(url: str, bodies: list[dict]) -> list[dict]:
        """The problems a replica finds in ``bodies`` ({index, message, param}); waits for one to be up."""
        deadline = time.monotonic() + cfg.retry_for
        while True:
            up = [r for r in dispatcher.registry if r.up and not r.draining]
            if up:
                resp = await client.http.post(up[0].url + "/batch_check", json={"url": url, "bodies": bodies},
                                              headers=client.headers)
                if resp.status_code == 200:
                    return resp.json()["problems"]
                if resp.status_code < 500:
                    raise RuntimeError(f"replica {up[0].name} cannot check batch bodies: POST /batch_check answered "
                                       f"HTTP {resp.status_code} {resp.text[:200]} (is it a polychip server?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replica was up for {cfg.retry_for:g}s to check the batch's bodies")
            await asyncio.sleep(1.0)

    jobs = BatchJobs(cfg, FileStore(files_dir or cfg.files_dir, cfg.max_file_bytes), BatchStore(state.store, state.repos.unreadable),
                     send, check, is_leader=lambda: state.is_leader, term=lambda: state.session.term, spawn=spawn)
    state.leader_hooks.append(jobs.leadership_changed)
    return jobs


def files_dir(cfg) -> str | None:
    """Where /v1/files keeps uploads: --files-dir, else beside the embedded (sqlite) state; N routers
    over etcd need one shared directory, so there the API stays off unless --files-dir names it."""
    if cfg.batch.files_dir is not None:
        return cfg.batch.files_dir
    if cfg.state != "sqlite":
        log.warning("/v1/files and /v1/batches are off: the state store is shared (%s) and the files "
                    "need a directory every router sees (--files-dir)", cfg.state.split("@")[-1])
        return None
    return os.path.join(cfg.state_dir or default_state_dir(cfg.port), "files")

