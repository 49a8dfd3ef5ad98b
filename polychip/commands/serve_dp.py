"""``polychip serve --dp-size N ...``: N replicas of the same serve flags on the chosen plugin's
devices (cpu: all share the one device, with the cores split between them), behind a
least-load router on --host/--port: the front. The front is what clients reach, so it takes the
API key and the TLS certificate (the replicas listen on this host with a key of their own, made
for this run and passed in their environment), and with --seccomp it runs under the front's
syscall filter (``polychip.trust.seccomp.apply_front``) while each replica applies serve's."""
from __future__ import annotations

import logging
import os
import secrets

from polychip.commands.common import fail, setup_logging
from polychip.commands.serve_flags import build_parser as serve_parser
from polychip.errors import ConfigError, PolychipError
from polychip.http import server as edge
from polychip.http.launcher import API_KEY_ENV
from polychip.http.serve_settings import parse_serve_args, serve_argv

# settings of the front only: where it listens, the key and certificate clients use, the
# device choice it spreads over the replicas
FRONT_ONLY = ("dp_size", "host", "port", "api_key", "device", "served_model_name", "ssl_certfile", "ssl_keyfile",
              "ssl_ca_certs")


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
        if args.seccomp:
            from polychip.trust.seccomp import check_available
            check_available()
        inventory = Inventory(tuple(args.plugins))
        replica_key = secrets.token_urlsafe(32)
        deployment = dp_deployment(args, replica_args(argv), inventory, {API_KEY_ENV: replica_key})
        placed = place(deployment, inventory)
        cfg = RouterConfig().replace(host=args.host, port=args.port, api_key=args.api_key,
                                     replica_api_key=replica_key, drain_timeout=args.graceful_shutdown_timeout + 5)
        tls = edge.uvicorn_tls(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
        sock = edge.bind(args.host, args.port)
    except PolychipError as e:
        return fail(e)
    try:
        return run_router(Router(cfg, [], deployment, None, placed, inventory), sock, tls,
                          seccomp_front=args.seccomp)
    except PolychipError as e:
        return fail(e)
    finally:
        sock.close()


def replica_args(argv: list[str]) -> list[str]:
    """The serve flags every replica gets: the serve settings of ``argv`` but the front's."""
    try:
        values = parse_serve_args(argv)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return serve_argv({k: v for k, v in values.items() if k not in FRONT_ONLY})


def dp_deployment(args, extra: list[str], inventory, env: dict[str, str] | None = None):
    """The Deployment of ``--dp-size`` replicas on the devices of ``--device``, each launched
    with ``env`` added to its environment."""
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
    replicas = [{"name": f"dp{i}", "model": name, "device": d, "args": extra, "env": dict(env or {})}
                for i, d in enumerate(devices)]
    return from_dict({"replicas": replicas, "models": [{"name": name, "versions": {"default": 1}}]},
                     source=f"--dp-size {n}")


def _default_model_name() -> str:
    from polychip.models.gguf import default_gguf_path
    return os.path.splitext(os.path.basename(default_gguf_path()))[0]
