"""Listening and serving: bind a socket before the slow start, the URL clients use, and the
uvicorn server both commands run (one ready line, SIGINT/SIGTERM as a graceful stop, extra
signal handlers such as the router's SIGHUP)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from typing import Callable

import uvicorn

from polychip.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """Bind before loading anything slow, so a busy port fails in a second, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)   # proto TCP: asyncio then sets TCP_NODELAY on accepted connections
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (for a child process to bind a moment later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def url_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host`` (a wildcard: loopback)."""
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    return f"[{host}]" if ":" in host else host


def socket_url(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    return f"{scheme}://{url_host(host)}:{port}"


def uvicorn_tls(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> dict:
    """uvicorn's ssl_* arguments: https with a certificate and its key; with ``ca_certs``, clients
    must present a certificate that CA signed. Nothing without a certificate."""
    if certfile is None:
        return {}
    import ssl
    out = {"ssl_certfile": certfile, "ssl_keyfile": keyfile}
    if ca_certs is not None:
        out.update(ssl_ca_certs=ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return out


PORT_FD_ENV = "POLYCHIP_PORT_FD"     # a launching router's pipe: the port goes there, not into the log


def report_port(sockets) -> None:
    """Write the bound port to the pipe a launching router handed down (its fd in ``PORT_FD_ENV``),
    once; the router learns the port from there only, never from the output a client can steer."""
    fd = os.environ.pop(PORT_FD_ENV, None)
    if fd is None or not sockets:
        return
    try:
        os.write(int(fd), f"{sockets[0].getsockname()[1]}\n".encode())
        os.close(int(fd))
    except (OSError, ValueError) as e:
        logging.getLogger("polychip.http").warning("cannot report the port to the launcher (%s=%s): %s",
                                                   PORT_FD_ENV, fd, e)


class ReadyServer(uvicorn.Server):
    """uvicorn.Server that logs one ready line once it accepts connections and installs the
    extra signal handlers it is given (signal -> coroutine function)."""

    def __init__(self, config: uvicorn.Config, ready_line: Callable[[], str], logger: logging.Logger,
                 on_signal: dict | None = None):
        super().__init__(config)
        self.ready_line, self.logger, self.on_signal = ready_line, logger, on_signal or {}

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            loop = asyncio.get_running_loop()
            for sig, handler in self.on_signal.items():
                loop.add_signal_handler(sig, lambda h=handler: asyncio.ensure_future(h()))
            self.logger.info("%s", self.ready_line())
            report_port(sockets)


def serve_on(server: uvicorn.Server, sock: socket.socket) -> None:
    """Run ``server`` on ``sock`` until SIGINT or SIGTERM has drained it. Our own no-op handlers:
    uvicorn re-raises the signal after a graceful stop, and we want a clean exit status, not a
    KeyboardInterrupt traceback."""
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def uvicorn_config(app, *, log_level: str, graceful_timeout: float, **options) -> uvicorn.Config:
    """The uvicorn.Config both commands use: our logging, our access log, lifespan on."""
    return uvicorn.Config(app, log_config=None, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=graceful_timeout, lifespan="on", **options)
