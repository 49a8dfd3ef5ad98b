"""Helpers for the router tests: fake replicas (small FastAPI apps that answer like polychip
serve, fast and controllable) and in-process servers on free ports."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from polychip.http.launcher import ChildProcess
from polychip.http.server import free_port


class ThreadServer:
    """Serve an ASGI app with uvicorn on 127.0.0.1:<free port> in a thread."""

    def __init__(self, app, port: int | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)   # asyncio sets TCP_NODELAY
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port or 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.server.install_signal_handlers = lambda: None      # not the main thread
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    def start(self, timeout: float = 20) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise TimeoutError("in-process server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class FakeReplica:
    """Answers /server_info and the two OpenAI routes, JSON or SSE, after ``delay`` seconds per
    token; ``mode`` makes it fail: "http500", "http503" (an engine that cannot serve), "full"
    (503 server_overloaded with Retry-After, as a full polychip serve), "error_event" (stream
    error before any token), "die_mid_stream" (drops the connection after the first token);
    ``poison`` (a prompt) gets a 500 whatever the mode. ``tail`` seconds pass between
    a stream's [DONE] and the end of its body (a busy server's late last write)."""

    def __init__(self, model="tiny", version="v1", device="cpu:0", dtypes=("float32", "bfloat16"),
                 max_running=64, delay=0.0, tokens=3, mode=None, cached_rate=0.0, tail=0.0, poison=None):
        self.model, self.version, self.device, self.dtypes = model, version, device, tuple(dtypes)
        self.max_running, self.delay, self.tokens, self.mode = max_running, delay, tokens, mode
        self.tail, self.poison = tail, poison
        self.served = 0
        self.hold = False              # while True, requests wait before answering
        self.inflight = 0
        self.peak_inflight = 0
        self.bodies: list[dict] = []
        self.extra_info: dict = {}     # more /server_info fields (device_compute, device_health, ...)
        self.app = self._build()

    def info(self) -> dict:
        kind, _, index = self.device.partition(":")
        return {"model": self.model, "version": self.version, "plugin": kind, "device_type": kind,
                "device_index": int(index or 0), "device": self.device, "dtype": "float32",
                "device_dtypes": list(self.dtypes), "quantization": None, "tp_size": 1,
                "max_running_requests": self.max_running, "num_waiting": 0, "num_running": self.inflight,
                "kv_usage": 0.0, "prefix_cache_hit_rate": 0.0, "pages_total": 100, "pages_free": 100,
                **self.extra_info}

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/server_info")
        async def server_info():
            return self.info()

        async def answer(request: Request, chat: bool):
            body = json.loads(await request.body())
            self.bodies.append(body)
            if self.mode == "http500" or (self.poison is not None and body.get("prompt") == self.poison):
                return JSONResponse({"error": {"message": "boom", "type": "internal_error"}}, status_code=500)
            if self.mode == "http503":
                return JSONResponse({"error": {"message": "engine dead", "type": "service_unavailable"}},
                                    status_code=503)
            if self.mode == "full":
                return JSONResponse({"error": {"message": "waiting queue full", "type": "server_overloaded"}},
                                    status_code=503, headers={"Retry-After": "1"})
            n = int(body.get("max_tokens") or self.tokens)
            while self.hold:
                await asyncio.sleep(0.01)
            self.inflight += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            if not body.get("stream"):
                try:
                    await asyncio.sleep(self.delay * n)
                finally:
                    self.inflight -= 1
                self.served += 1
                text = "x" * n
                choice = {"index": 0, "finish_reason": "length",
                          **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
                return {"id": "c1", "object": "chat.completion" if chat else "text_completion", "model": self.model,
                        "choices": [choice], "usage": usage}

            async def events():
                try:
                    if chat:
                        yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    if self.mode == "error_event":
                        yield _sse({"error": {"message": "the engine crashed", "type": "service_unavailable"}})
                        yield "data: [DONE]\n\n"
                        return
                    for i in range(n):
                        await asyncio.sleep(self.delay)
                        piece = {"delta": {"content": "x"}} if chat else {"text": "x"}
                        if body.get("return_token_ids"):      # as polychip serve: each chunk's new token ids
                            piece["token_ids"] = [7]
                        yield _sse({"choices": [{"index": 0, **piece, "finish_reason": None}]})
                        if self.mode == "die_mid_stream":
                            raise ConnectionError("replica died")
                    yield _sse({"choices": [{"index": 0, "finish_reason": "length",
                                             **({"delta": {}} if chat else {"text": ""})}]})
                    if (body.get("stream_options") or {}).get("include_usage"):    # as polychip serve
                        yield _sse({"choices": [], "usage": usage})
                    self.served += 1      # before [DONE]: the router answers a gathered JSON request on it
                    yield "data: [DONE]\n\n"
                    await asyncio.sleep(self.tail)
                finally:
                    self.inflight -= 1
            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await answer(request, False)

        @app.post("/batch_check")       # the server's own body checks (server/batch_check.py)
        async def batch_check(request: Request):
            from polychip.server.batch_check import body_problem
            data = json.loads(await request.body())
            problems = [(i, body_problem(data["url"], body)) for i, body in enumerate(data["bodies"])]
            return {"problems": [{"index": i, "message": why[0], "param": why[1]} for i, why in problems if why]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await answer(request, True)

        return app


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def start_router(cfg, urls=(), deployment=None, deployment_path=None):
    """(ThreadServer, Router) for a router in this process."""
    from polychip.router.app import Router
    from polychip.router.asgi import build_app
    router = Router(cfg, list(urls), deployment, deployment_path)
    server = ThreadServer(build_app(router)).start()
    return server, router


def wait_for(pred, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture
def router_stack():
    """make(fakes, deployment=None, **settings) -> (router url, Router) over in-process fake replicas,
    health-checked fast; every server stops at the end of the test."""
    from polychip.router.settings import HealthConfig, RouterConfig
    fast = HealthConfig(interval=0.2, timeout=2, failure_threshold=2, success_threshold=1)
    started = []

    def make(fakes, deployment=None, **cfg):
        servers = [ThreadServer(f.app).start() for f in fakes]
        started.extend(servers)
        dep = deployment(servers) if deployment else None
        srv, router = start_router(RouterConfig(health=fast, **cfg), [] if dep else [s.url for s in servers], dep)
        started.append(srv)
        wait_for(lambda: router.registry.workers and all(r.up for r in router.registry.workers.values()),
                 10, "replicas up")
        return srv.url, router

    yield make
    for s in reversed(started):
        s.stop()


class RouterProcess(ChildProcess):
    """``polychip router ...`` in a subprocess on a free port; ``wait_ready(n)`` waits until n
    replicas are up."""

    def __init__(self, args: list[str], env: dict | None = None):
        import sys
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "polychip.cli", "router", "--port", str(self.port), *args], env)

    def replicas(self) -> list[dict]:
        import httpx
        return httpx.get(self.url + "/admin/replicas", timeout=10).json()["replicas"]

    def wait_ready(self, n: int, timeout: float = 180) -> "RouterProcess":
        import httpx

        def up() -> bool:
            h = httpx.get(self.url + "/health", timeout=2)
            return h.status_code == 200 and h.json()["replicas_up"] >= n
        self.wait_until(up, timeout, f"router ({n} replicas)")
        return self

    def stop(self, timeout: float = 60) -> int:
        return super().stop(timeout=timeout)
