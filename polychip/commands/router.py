"""polychip router: one OpenAI endpoint over many replicas.

  polychip router --replica http://h1:30000 --replica http://h2:30000 [--policy least_load]
  polychip router --deployment deploy.yaml          (launches and supervises the replicas)
  polychip router rollout status [--url URL]
  polychip router rollout set MODEL v1=90 v2=10 [--url URL]
  polychip router reload [--url URL]                (re-read the deployment file; SIGHUP does too)

``polychip serve --dp-size N ...`` is a router over N local replicas (see ``serve_dp``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys

import httpx
import uvicorn

from polychip.commands.common import fail, setup_logging
from polychip.errors import ConfigError, PolychipError

log = logging.getLogger("polychip.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polychip router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("replicas")
    g.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a running polychip serve (or SGLang-compatible) replica; repeatable")
    g.add_argument("--deployment", default=None, metavar="FILE.yaml",
                   help="replicas to launch and supervise, models with version weights, router settings")
    g = p.add_argument_group("router (flags override the deployment file's router section)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--policy", default=None, choices=["round_robin", "least_load", "prefix_aware"])
    g.add_argument("--health-check-interval", type=float, default=None, help="seconds (default 5)")
    g.add_argument("--health-check-timeout", type=float, default=None, help="seconds (default 5)")
    g.add_argument("--health-failure-threshold", type=int, default=None, help="failures that mark down (3)")
    g.add_argument("--health-success-threshold", type=int, default=None, help="successes that mark up (2)")
    g.add_argument("--max-retries", type=int, default=None, help="other replicas tried before the first token (2)")
    g.add_argument("--max-inflight-per-replica", type=int, default=None,
                   help="requests in flight per replica before the router queues (default: its max running)")
    g.add_argument("--max-queue", type=int, default=None, help="queued requests before 503 (1024)")
    g.add_argument("--queue-timeout", type=float, default=None, help="longest wait in the queue (60 s)")
    g.add_argument("--request-timeout", type=float, default=None, help="longest silence from a replica (600 s)")
    g.add_argument("--priority-weights", default=None, help="WFQ weights, e.g. high=3,normal=1,low=1")
    g.add_argument("--canary-max-error-rate", type=float, default=None, help="guard limit (0.001)")
    g.add_argument("--canary-max-p95-ratio", type=float, default=None, help="guard limit vs baseline (1.5)")
    g.add_argument("--canary-min-samples", type=int, default=None, help="guard sample minimum (20)")
    g.add_argument("--api-key", default=None, help="clients must send it (not /health, /metrics)")
    g.add_argument("--replica-api-key", default=None, help="sent to the replicas")
    g.add_argument("--drain-timeout", type=float, default=None, help="in-flight grace on SIGTERM (30 s)")
    g = p.add_argument_group("state (weights, rollbacks, replica registry, leader; docs/router.md)")
    g.add_argument("--state", default=None, metavar="SPEC",
                   help="sqlite (default: a file in --state-dir), etcd://h1:2379,h2:2379 (N routers) or memory://")
    g.add_argument("--state-dir", default=None, help="sqlite's directory (default $POLYCHIP_STATE_DIR, else "
                   "~/.local/state/polychip/router-PORT)")
    g.add_argument("--node-id", default=None, help="this router's name among N (default HOST-PORT)")
    g.add_argument("--state-lease-ttl", type=float, default=None,
                   help="seconds a dead router's leadership and registry outlive it (10)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def router_config(args, base=None):
    """RouterConfig from the deployment's router section (or defaults), then the flags given."""
    import dataclasses

    from polychip.router.config import GuardConfig, HealthConfig, RouterConfig, parse_priority_weights
    cfg = base or RouterConfig()
    health = dataclasses.replace(cfg.health, **_given(interval=args.health_check_interval,
                                                      timeout=args.health_check_timeout,
                                                      failure_threshold=args.health_failure_threshold,
                                                      success_threshold=args.health_success_threshold))
    guard = dataclasses.replace(cfg.guard, **_given(max_error_rate=args.canary_max_error_rate,
                                                    max_p95_ratio=args.canary_max_p95_ratio,
                                                    min_samples=args.canary_min_samples))
    weights = parse_priority_weights(args.priority_weights) if args.priority_weights else None
    return cfg.replace(health=HealthConfig(**vars(health)), guard=GuardConfig(**vars(guard)),
                       **_given(policy=args.policy, max_retries=args.max_retries,
                                max_inflight_per_replica=args.max_inflight_per_replica, max_queue=args.max_queue,
                                queue_timeout=args.queue_timeout, request_timeout=args.request_timeout,
                                priority_weights=weights, api_key=args.api_key,
                                replica_api_key=args.replica_api_key, drain_timeout=args.drain_timeout,
                                state=args.state, state_dir=args.state_dir, node_id=args.node_id,
                                state_lease_ttl=args.state_lease_ttl))


def _given(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["rollout"], ["reload"]):
        return admin_main(argv)
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)     # one line per health check otherwise
    try:
        if not args.replica and not args.deployment:
            raise ConfigError("give --replica URL (repeatable) or --deployment FILE.yaml")
        deployment = placed = None
        if args.deployment:
            from polychip.router.deployment import load_deployment
            from polychip.router.placement import plan
            deployment = load_deployment(args.deployment)
            placed = plan(deployment)   # refuse what no device here can serve, before binding
        cfg = router_config(args, deployment.router_config() if deployment else None)
        if cfg.health.interval > 30:
            log.warning("health-check interval %.0fs: a dead replica stays in rotation that long between "
                        "checks (requests to it are retried elsewhere, but a shorter interval is advised)",
                        cfg.health.interval)
        from polychip.commands.serve import bind
        sock = bind(args.host, args.port)
    except PolychipError as e:
        return fail(e)
    try:
        return run_router(cfg, sock, args.replica, deployment, args.deployment, placed)
    except PolychipError as e:
        return fail(e)
    finally:
        sock.close()


def run_router(cfg, sock, replica_urls, deployment, deployment_path, placed=None) -> int:
    from polychip.router.app import Router, build_app
    from polychip.router.state import default_state_dir
    host, port = sock.getsockname()[:2]
    if cfg.state == "sqlite" and cfg.state_dir is None:
        cfg = cfg.replace(state_dir=default_state_dir(port))
    cfg = cfg.replace(node_id=cfg.node_id or f"{socket.gethostname()}-{port}")
    router = Router(cfg, replica_urls, deployment, deployment_path, placed)
    app = build_app(router)
    uv = uvicorn.Config(app, log_config=None, log_level=cfg_log_level(), access_log=False,
                        timeout_graceful_shutdown=cfg.drain_timeout, lifespan="on")
    server = RouterServer(uv, router, f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}")
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if router.startup_error is not None:
        raise router.startup_error
    log.info("polychip router stopped")
    return 0


def cfg_log_level() -> str:
    return logging.getLevelName(logging.getLogger().level).lower()


class RouterServer(uvicorn.Server):
    """uvicorn.Server that logs a ready line and reloads the deployment on SIGHUP."""

    def __init__(self, config, router, url: str):
        super().__init__(config)
        self.router, self.url = router, url

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self._reload()))
            log.info("polychip router ready: %s (%d replica(s), policy %s)", self.url,
                     len(self.router.dispatcher.replicas), self.router.cfg.policy)

    async def _reload(self):
        try:
            await self.router.reload()
        except PolychipError as e:
            log.error("SIGHUP reload refused, the running set is unchanged: %s", e)


# admin commands
def admin_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"polychip router {argv[0]}")
    p.add_argument("--url", default=os.environ.get("POLYCHIP_ROUTER_URL", "http://127.0.0.1:30000"))
    p.add_argument("--api-key", default=os.environ.get("POLYCHIP_API_KEY"))
    if argv[0] == "rollout":
        p.add_argument("action", choices=["status", "set"])
        p.add_argument("model", nargs="?")
        p.add_argument("weights", nargs="*", metavar="VERSION=WEIGHT")
    args = p.parse_args(argv[1:])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/")
    try:
        if argv[0] == "reload":
            r = httpx.post(f"{base}/admin/reload", headers=headers, timeout=120)
        elif args.action == "status":
            r = httpx.get(f"{base}/admin/rollout", headers=headers, timeout=30)
        else:
            if not args.model or not args.weights:
                print("error: rollout set MODEL VERSION=WEIGHT [VERSION=WEIGHT ...]", file=sys.stderr)
                return 2
            weights = {}
            for w in args.weights:
                name, sep, value = w.partition("=")
                try:
                    weights[name] = float(value)
                except ValueError:
                    sep = ""
                if not sep:
                    print(f"error: {w!r}: expected VERSION=WEIGHT", file=sys.stderr)
                    return 2
            r = httpx.post(f"{base}/admin/rollout", json={"model": args.model, "weights": weights},
                           headers=headers, timeout=30)
    except httpx.HTTPError as e:
        print(f"error: cannot reach the router at {base}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        msg = r.json().get("error", {}).get("message", r.text) if r.headers.get("content-type", "").startswith(
            "application/json") else r.text
        print(f"error: HTTP {r.status_code}: {msg}", file=sys.stderr)
        return 1
    data = r.json()
    if argv[0] == "rollout":
        print(format_rollout(data["models"]))
    else:
        print(json.dumps(data, indent=2))
    return 0


def format_rollout(models: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f}"
    rows = [f"{'model':<16} {'version':<12} {'weight':>7} {'requests':>9} {'errors':>7} {'err%':>6} "
            f"{'ttft p50/p95 ms':>16} {'e2e p50/p95 ms':>16}  note"]
    for name, m in models.items():
        for v, s in m["versions"].items():
            note = "baseline" if s["baseline"] else ""
            if s["rolled_back"]:
                note = f"rolled back: {s['rolled_back']}"
            rows.append(f"{name:<16} {v:<12} {s['weight']:>7g} {s['requests']:>9} {s['errors']:>7} "
                        f"{100 * s['error_rate']:>5.1f}% {ms(s['ttft_p50']) + '/' + ms(s['ttft_p95']):>16} "
                        f"{ms(s['e2e_p50']) + '/' + ms(s['e2e_p95']):>16}  {note}")
    return "\n".join(rows)


# polychip serve --dp-size N
ROUTER_LEVEL = ("--dp-size", "--host", "--port", "--api-key", "--device", "--served-model-name")


def serve_dp(argv: list[str]) -> int:
    """``polychip serve --dp-size N ...``: N replicas of the same serve flags on the chosen plugin's
    devices (cpu: all share the one device, with the cores split between them), behind a
    least-load router on --host/--port that checks the API key."""
    from polychip.commands.serve import bind, build_parser as serve_parser
    args = serve_parser().parse_args(argv)
    setup_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.dp_size is None or args.dp_size < 1:
            raise ConfigError(f"--dp-size must be >= 1, got {args.dp_size}")
        deployment, records = dp_deployment(args, replica_args(argv))
        from polychip.router.config import RouterConfig
        from polychip.router.placement import plan
        placed = plan(deployment, records)
        cfg = RouterConfig(api_key=args.api_key, drain_timeout=args.graceful_shutdown_timeout + 5)
        sock = bind(args.host, args.port)
    except PolychipError as e:
        return fail(e)
    try:
        return run_router(cfg, sock, [], deployment, None, placed)
    except PolychipError as e:
        return fail(e)
    finally:
        sock.close()


def replica_args(argv: list[str]) -> list[str]:
    """The serve flags every replica gets: all but the router-level ones."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in ROUTER_LEVEL:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def dp_deployment(args, extra: list[str]):
    """(Deployment, plugin records) for ``--dp-size`` replicas on the devices of ``--device``."""
    from polychip.devices.discovery import discover_plugins, parse_device, select
    from polychip.router.deployment import from_dict
    records = discover_plugins(tuple(args.plugins))
    kind, index = parse_device(args.device)
    if kind == "auto":
        kind = select(records, "auto")[0].name
    n = args.dp_size
    devices = [kind] * n if kind == "cpu" else [f"{kind}:{(index or 0) + i}" for i in range(n)]
    if kind == "cpu" and args.num_threads is None:
        extra = [*extra, "--num-threads", str(max(1, (os.cpu_count() or 1) // n))]
    name = args.served_model_name or args.model_path or _default_model_name()
    replicas = [{"name": f"dp{i}", "model": name, "device": d, "args": extra} for i, d in enumerate(devices)]
    dep = from_dict({"replicas": replicas, "models": [{"name": name, "versions": {"default": 1}}]},
                    source=f"--dp-size {n}")
    return dep, records


def _default_model_name() -> str:
    from polychip.models.gguf import default_gguf_path
    return os.path.splitext(os.path.basename(default_gguf_path()))[0]
