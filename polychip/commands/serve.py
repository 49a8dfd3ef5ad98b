"""polychip serve: the OpenAI-compatible HTTP server (SGLang's flag names)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from polychip.commands.common import engine_config_from_args, fail, setup_logging
from polychip.commands.serve_flags import build_parser
from polychip.config import EngineConfig, ServerConfig
from polychip.errors import ConfigError, PolychipError
from polychip.flags import config_from_args
from polychip.http import server as edge
from polychip.http.launcher import API_KEY_ENV

log = logging.getLogger("polychip.serve")


@contextlib.contextmanager
def progress(label: str):
    """An elapsed-time line on a terminal while ``label`` runs; log records (and the GGUF
    converter's own bar) are printed above it through tqdm, so nothing garbles."""
    t0, stop = time.perf_counter(), threading.Event()
    log.info("%s ...", label)
    with logging_redirect_tqdm(), tqdm(desc=label, bar_format="{desc} ... {elapsed}", file=sys.stderr,
                                       disable=not sys.stderr.isatty(), leave=False) as bar:
        ticker = threading.Thread(target=lambda: [bar.refresh() for _ in iter(lambda: stop.wait(0.25), True)],
                                  daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
    log.info("%s: done in %.1fs", label, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--dp-size" or a.startswith("--dp-size=") for a in argv):   # N replicas behind a router
        from polychip.commands.serve_dp import serve_dp
        return serve_dp(argv)
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        engine_config = engine_config_from_args(args)
        server_config = config_from_args(args, ServerConfig)
        if server_config.api_key is None and os.environ.get(API_KEY_ENV):   # a launcher's key, kept out of ps
            server_config = dataclasses.replace(server_config, api_key=os.environ[API_KEY_ENV])
        if engine_config.node_rank > 0:     # only node 0 serves HTTP; the others run their worker ranks
            if server_config.seccomp:
                raise ConfigError("--seccomp filters node 0's serving process; a --node-rank > 0 node serves none")
            from polychip.engine.rank_workers import run_node
            return run_node(_open_package(engine_config, args))
        if server_config.seccomp:
            from polychip.trust.seccomp import check_available
            check_available()               # refused now, not after the model load
        sock = edge.bind(server_config.host, server_config.port)
    except PolychipError as e:
        return fail(e)
    try:
        return _serve(_open_package(engine_config, args), server_config, sock)
    except PolychipError as e:
        return fail(e)
    finally:
        sock.close()


def _open_package(engine_config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """The device spec checked against the trust store, and a .pcpkg --model-path verified and
    extracted, before anything of them is loaded (else as is)."""
    from polychip.package.opening import PackageOptions, engine_config_for
    from polychip.trust.options import TrustOptions
    return engine_config_for(engine_config, config_from_args(args, PackageOptions),
                             config_from_args(args, TrustOptions))


def _serve(engine_config: EngineConfig, config: ServerConfig, sock: socket.socket) -> int:
    from polychip.engine.engine import Engine
    from polychip.http.timeouts import uvicorn_options
    from polychip.server.openai_api import build_app

    grace = config.graceful_shutdown_timeout
    with progress(f"loading {engine_config.model_path or 'the default model (SmolLM2-135M-Instruct)'}"):
        engine = Engine(engine_config)
    engine.startup.update(warmup=None, warmed_at=None)
    if not config.skip_server_warmup:
        from polychip.engine.warmup import warm_up
        began = time.time()
        with progress("warming up"):
            shapes = warm_up(engine)
        engine.startup.update(warmup=time.time() - began, warmed_at=time.time())
        log.info("warm-up forwards: %s", ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in shapes.items()))
    if engine.disagg is not None:
        engine.disagg.name_after(edge.socket_url(sock, "https" if config.ssl_certfile else "http"))
    app, state = build_app(engine, config)
    # uvicorn's own timeout is only a backstop: EngineServer ends streams cleanly after `grace`
    uv_config = edge.uvicorn_config(app, log_level=config.log_level, graceful_timeout=grace + 5,
                                    **uvicorn_options(config.timeout_request_header, config.timeout_keep_alive),
                                    **edge.uvicorn_tls(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs))
    server = EngineServer(uv_config, edge.socket_url(sock, "https" if config.ssl_certfile else "http"), state.engine,
                          grace)
    if config.seccomp:                  # loaded and bound: from here on only the allowlist
        from polychip.trust.seccomp import apply
        apply()
    try:
        edge.serve_on(server, sock)
    finally:
        engine.shutdown()
    if server.fatal_reason is not None:
        log.error("polychip stopped after a fatal fault: %s", server.fatal_reason)
        return 1
    log.info("polychip stopped")
    return 0


FAULT_LINGER = 2.0   # seconds a failed server keeps answering /health (503) before it exits


class EngineServer(edge.ReadyServer):
    """The edge's server with the engine's lifecycle: one ready line with the URL; an engine fault
    fails what is in flight and exits; on shutdown in-flight requests get ``grace`` seconds before
    they are aborted (their streams end with an error event and [DONE], so no client hangs)."""

    def __init__(self, config, url: str, async_engine, grace: float):
        super().__init__(config, lambda: f"polychip ready: {url} (OpenAI API at {url}/v1)", log)
        self.url, self.async_engine, self.grace = url, async_engine, grace
        self.fatal_reason: str | None = None

    async def startup(self, sockets=None):
        loop = asyncio.get_running_loop()
        self.async_engine.on_fault(lambda reason: loop.call_soon_threadsafe(self.fatal, reason))
        await super().startup(sockets)

    def fatal(self, reason: str) -> None:
        """The engine can never step again (a tensor-parallel rank failed): fail what is in flight,
        answer /health with 503 for FAULT_LINGER seconds so callers can see why, then exit non-zero."""
        if self.fatal_reason is not None:
            return
        self.fatal_reason = reason
        log.error("fatal: %s; failing in-flight requests and exiting in %.0fs", reason, FAULT_LINGER)
        self.async_engine.abort_all(f"the server failed: {reason}")
        asyncio.get_running_loop().call_later(FAULT_LINGER, setattr, self, "should_exit", True)

    async def shutdown(self, sockets=None):
        ae = self.async_engine
        busy = ae.stats.num_running + ae.stats.num_waiting
        if busy:
            log.info("shutting down: %d request(s) in flight get %.0fs to finish", busy, self.grace)

        async def abort_later():
            await asyncio.sleep(self.grace)
            if ae.stats.num_running + ae.stats.num_waiting:
                log.info("grace period over: aborting %d running and %d waiting request(s)",
                         ae.stats.num_running, ae.stats.num_waiting)
            ae.abort_all("the server is shutting down")
        timer = asyncio.ensure_future(abort_later())
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
