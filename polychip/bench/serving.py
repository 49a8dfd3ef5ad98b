"""Drive any OpenAI-compatible server with streaming completions, one concurrency step at a time.

TTFT is send -> first non-empty text chunk; inter-token latency is the gap between chunks;
the output length is the server's ``usage.completion_tokens`` when it sends usage, else the
number of non-empty chunks.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from polychip.bench.datasets import BenchRequest
from polychip.bench.stats import RequestResult, summarize
from polychip.bench import stage_metrics


@dataclass
class ServingConfig:
    base_url: str
    model: str | None = None            # None: the first id from GET /v1/models
    api_key: str | None = None
    ignore_eos: bool = True             # vLLM / SGLang / polychip extension: generate exactly output_len
    timeout_s: float = 3600.0
    extra_body: dict = field(default_factory=dict)
    progress: bool = True
    extra_headers: dict = field(default_factory=dict)     # e.g. a router's x-polychip-slo-* targets
    flush_cache: bool = False           # POST /flush_cache (SGLang's) before each step: no cached prompts of a past run


def api_root(base_url: str) -> str:
    """'http://h:p', 'http://h:p/' and 'http://h:p/v1' all give 'http://h:p'."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def _headers(cfg: ServingConfig) -> dict:
    return {**cfg.extra_headers, **({"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {})}


async def discover_model(client: httpx.AsyncClient, cfg: ServingConfig) -> str:
    r = await client.get(f"{api_root(cfg.base_url)}/v1/models", headers=_headers(cfg))
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{cfg.base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


async def flush_cache(client: httpx.AsyncClient, cfg: ServingConfig) -> None:
    """Empty the server's prefix cache (SGLang's and polychip's ``/flush_cache``): a second run with the same
    ``--seed`` sends the same prompts, and would otherwise start on their cached pages."""
    url = f"{api_root(cfg.base_url)}/flush_cache"
    r = await client.post(url, headers=_headers(cfg))
    if r.status_code >= 400:
        raise RuntimeError(f"--flush-cache: POST {url} answered HTTP {r.status_code} ({r.text[:200]!r}); this "
                           "server has no SGLang-style /flush_cache, so run without --flush-cache and another --seed")


def _body(cfg: ServingConfig, model: str, req: BenchRequest) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body.update(ignore_eos=True, min_tokens=req.output_len)
    body.update(cfg.extra_body)
    return body


async def send_request(client: httpx.AsyncClient, cfg: ServingConfig, model: str,
                       req: BenchRequest) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len)
    chunks, usage_tokens = 0, None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{api_root(cfg.base_url)}/v1/completions", json=_body(cfg, model, req),
                                 headers=_headers(cfg)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                res.error = f"HTTP {resp.status_code}: {text}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {str(msg['error'])[:200]}"
                    return res
                now = time.perf_counter()
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens", usage_tokens)
                choices = msg.get("choices") or []
                if choices and choices[0].get("text"):
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
        res.output_len = usage_tokens if usage_tokens is not None else chunks
        if res.output_len == 0:
            res.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


async def run_step(cfg: ServingConfig, model: str, requests: list[BenchRequest], concurrency: int,
                   client: httpx.AsyncClient) -> tuple[list[RequestResult], float]:
    """Send all ``requests`` with at most ``concurrency`` in flight; (results, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(requests), desc=f"concurrency {concurrency}", disable=not cfg.progress, leave=False)

    async def one(req):
        async with gate:
            r = await send_request(client, cfg, model, req)
            bar.update(1)
            return r

    start = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in requests))
    wall = time.perf_counter() - start
    bar.close()
    return list(results), wall


async def _sweep(cfg: ServingConfig, requests_for, concurrencies: list[int]) -> dict:
    limits = httpx.Limits(max_connections=max(concurrencies) + 4, max_keepalive_connections=max(concurrencies) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits) as client:
        model = cfg.model or await discover_model(client, cfg)
        # warm-up on a prompt of its own, so that no measured prompt starts with a cached prefix
        await send_request(client, cfg, model, BenchRequest("Warm-up: count from one to ten.", 8, 4))
        steps = []
        for c in concurrencies:
            if cfg.flush_cache:
                await flush_cache(client, cfg)
            before = await stage_metrics.scrape(client, api_root(cfg.base_url))
            results, wall = await run_step(cfg, model, requests_for(c), c, client)
            after = await stage_metrics.scrape(client, api_root(cfg.base_url))
            step = summarize(results, wall, c)
            step["stages"] = stage_metrics.delta(before, after)
            steps.append(step)
    return {"model": model, "steps": steps}


def run_sweep(cfg: ServingConfig, requests_for, concurrencies: list[int]) -> dict:
    """``requests_for(concurrency)`` gives the requests of one step. Returns {model, steps}."""
    return asyncio.run(_sweep(cfg, requests_for, concurrencies))
