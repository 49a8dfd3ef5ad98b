"""polychip router: one OpenAI endpoint over many replicas.

  polychip router --replica http://h1:30000 --replica http://h2:30000 [--policy fastest]
  polychip router --deployment deploy.yaml          (launches and supervises the replicas)
  polychip router --state-dir DIR                   (no replicas yet: `polychip workload submit` adds them)
  polychip router rollout status [--url URL]
  polychip router rollout set MODEL v1=90 v2=10 [--url URL]
  polychip router reload [--url URL]                (re-read the deployment file; SIGHUP does too)

Every router setting is a flag here and a key of the deployment file's ``router:`` section
(``polychip/router/settings.py``); a flag given here wins over the file, also on reload.
``polychip serve --dp-size N ...`` is a router over N local replicas (``commands/serve_dp.py``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import httpx

from polychip.commands.common import fail, setup_logging
from polychip.errors import PolychipError
from polychip.flags import Parser, add_config_args, config_from_args
from polychip.http import server as edge
from polychip.router.settings_flags import add_settings_args, settings_from_args
from polychip.trust.options import RouterTrust

log = logging.getLogger("polychip.router")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="polychip router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("replicas")
    g.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a running polychip serve (or SGLang-compatible) replica; repeatable")
    g.add_argument("--deployment", default=None, metavar="FILE.yaml",
                   help="replicas to launch and supervise, models with version weights, router settings")
    add_settings_args(p)
    add_config_args(p, RouterTrust)     # flags only, never the file's: the store is what checks the file
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["rollout"], ["reload"]):
        return admin_main(argv)
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)     # one line per health check otherwise
    try:
        trust = config_from_args(args, RouterTrust)
        if not args.replica and not args.deployment:
            log.info("no --replica or --deployment: the router starts empty; `polychip workload submit` "
                     "launches replicas on it")
        deployment = placed = None
        inventory = None
        if args.deployment:
            from polychip.router.deployment import load_deployment
            from polychip.router.fleet.inventory import Inventory
            from polychip.router.fleet.placement import place
            deployment, inventory = load_deployment(args.deployment, trust), Inventory()
            placed = place(deployment, inventory)   # refuse what no device here can serve, before binding
        cfg = settings_from_args(args, deployment.router if deployment else None)
        if cfg.health.interval > 30:
            log.warning("health-check interval %.0fs: a dead replica stays in rotation that long between "
                        "checks (requests to it are retried elsewhere, but a shorter interval is advised)",
                        cfg.health.interval)
        sock = edge.bind(cfg.host, cfg.port)
    except PolychipError as e:
        return fail(e)
    try:
        from polychip.router.app import Router
        router = Router(cfg, args.replica, deployment, args.deployment, placed, inventory,
                        settings_from_file=lambda dep: settings_from_args(args, dep.router), trust=trust)
        router.state.open()            # a store that refuses this router: one line, before it serves
        return run_router(router, sock)
    except PolychipError as e:
        return fail(e)
    finally:
        sock.close()


def run_router(router, sock, tls: dict | None = None, seccomp_front: bool = False) -> int:
    """Serve ``router`` on ``sock`` through the edge until SIGINT/SIGTERM; SIGHUP reloads. ``tls``:
    uvicorn's ssl arguments (``edge.uvicorn_tls``); ``seccomp_front``: the front's syscall filter
    first (``serve --dp-size --seccomp``)."""
    from polychip.http.timeouts import uvicorn_options
    from polychip.router.asgi import build_app
    cfg = router.cfg
    uv = edge.uvicorn_config(build_app(router), log_level=cfg_log_level(), graceful_timeout=cfg.drain_timeout,
                             **uvicorn_options(cfg.timeout_request_header, cfg.timeout_keep_alive), **(tls or {}))
    url = router.url = edge.socket_url(sock, "https" if tls else "http")
    if seccomp_front:
        from polychip.trust.seccomp import apply_front
        apply_front()

    async def reload_on_sighup():
        try:
            await router.reconciler.reload()
        except PolychipError as e:
            log.error("SIGHUP reload refused, the running set is unchanged: %s", e)
    ready = lambda: (f"polychip router ready: {url} ({len(router.registry)} replica(s), "  # noqa: E731
                     f"policy {router.cfg.policy})")
    server = edge.ReadyServer(uv, ready, log, {signal.SIGHUP: reload_on_sighup})
    router.runtime.on_fatal = lambda name, e: setattr(server, "should_exit", True)   # a critical loop cannot go on
    edge.serve_on(server, sock)
    if router.startup_error is not None:
        raise router.startup_error
    if router.runtime.fatal is not None:
        name, e = router.runtime.fatal
        log.error("polychip router stopped: its background loop %r cannot go on (%s: %s)", name, type(e).__name__, e)
        return 1
    log.info("polychip router stopped")
    return 0


def cfg_log_level() -> str:
    return logging.getLevelName(logging.getLogger().level).lower()


# admin commands
def admin_main(argv: list[str]) -> int:
    p = Parser(prog=f"polychip router {argv[0]}")
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
