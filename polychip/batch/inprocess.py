"""The server's own app on an engine in this process, reached through httpx's ASGI transport (no
socket): every batch body is answered exactly as ``polychip serve`` would answer it, refusals
included, as vLLM's run-batch calls its serving layer in-process."""
from __future__ import annotations

import asyncio
import uuid

import httpx

from polychip.router.batch.lines import BatchRequest
from polychip.router.batch.records import response_record
from polychip.config import EngineConfig, ServerConfig


class InProcessServer:
    def __init__(self, config: EngineConfig, max_tokens_default: int | None, concurrency: int):
        self.config = config
        # the waiting queue holds every request the runner keeps in flight
        self.server_config = ServerConfig(max_tokens_default=max_tokens_default,
                                          max_waiting_requests=max(1024, concurrency))
        self.client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> "InProcessServer":
        from polychip.commands.serve import progress
        from polychip.engine.engine import Engine
        from polychip.server.openai_api import build_app
        with progress(f"loading {self.config.model_path or 'the default model (SmolLM2-135M-Instruct)'}"):
            engine = Engine(self.config)
        app, self.state = build_app(engine, self.server_config)
        self.state.engine.start(asyncio.get_running_loop())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                                        timeout=None)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await asyncio.to_thread(self.state.engine.shutdown, 5.0)

    async def send(self, req: BatchRequest) -> dict:
        rid = f"req_{uuid.uuid4().hex}"
        resp = await self.client.post(req.url, json=req.body, headers={"x-request-id": rid})
        try:
            body = resp.json()
        except ValueError:
            body = {"error": {"message": resp.text[:1000], "type": "internal_error", "param": None,
                              "code": resp.status_code}}
        return response_record(req.custom_id, resp.status_code, resp.headers.get("x-request-id", rid), body)
