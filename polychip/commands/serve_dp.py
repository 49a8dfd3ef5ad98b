"""``polychip serve --dp-size N ...``: N replicas of the same serve flags on the chosen plugin's
devices (cpu: all share the one device, with the cores split between them), behind a
least-load router on --host/--port that checks the API key."""
from __future__ import annotations

import logging
import os

from polychip.commands.common import fail, setup_logging
from polychip.commands.serve_flags import build_parser as serve_parser
from polychip.errors import ConfigError, PolychipError
from polychip.http import server as edge

ROUTER_LEVEL = ("--dp-size", "--host", "--port", "--api-key", "--device", "--served-model-name")


def serve_dp(argv: list[str]) -> int:
    from polychip.commands.router import run_router
    from polychip.router.app import Router
    from polychip.router.fleet.inventory import Inventory
    from polychip.router.fleet.placement import place
    from polychip.router.settings import RouterConfig
    args = serve_parser().parse_args(argv)
    setup_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.dp_size is None or args.dp_size < 1:
            raise ConfigError(f"--dp-size must be >= 1, got {args.dp_size}")
        inventory = Inventory(tuple(args.plugins))
        deployment = dp_deployment(args, replica_args(argv), inventory)
        placed = place(deployment, inventory)
        cfg = RouterConfig().replace(host=args.host, port=args.port, api_key=args.api_key,
                                     drain_timeout=args.graceful_shutdown_timeout + 5)
        sock = edge.bind(args.host, args.port)
    except PolychipError as e:
        return fail(e)
    try:
        return run_router(Router(cfg, [], deployment, None, placed, inventory), sock)
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


def dp_deployment(args, extra: list[str], inventory):
    """The Deployment of ``--dp-size`` replicas on the devices of ``--device``."""
    from polychip.router.deployment import from_dict
    from polychip.router.fleet.inventory import auto_device_type
    from polychip.router.fleet.placement import split_device
    kind, index = split_device(args.device)
    if kind == "auto":
        kind = auto_device_type(inventory.get())
    n = args.dp_size
    devices = [kind] * n if kind == "cpu" else [f"{kind}:{(index or 0) + i}" for i in range(n)]
    if kind == "cpu" and args.num_threads is None:
        extra = [*extra, "--num-threads", str(max(1, (os.cpu_count() or 1) // n))]
    name = args.served_model_name or args.model_path or _default_model_name()
    replicas = [{"name": f"dp{i}", "model": name, "device": d, "args": extra} for i, d in enumerate(devices)]
    return from_dict({"replicas": replicas, "models": [{"name": name, "versions": {"default": 1}}]},
                     source=f"--dp-size {n}")


def _default_model_name() -> str:
    from polychip.models.gguf import default_gguf_path
    return os.path.splitext(os.path.basename(default_gguf_path()))[0]
