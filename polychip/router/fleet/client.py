"""The one HTTP client to the replicas: httpx over TCP without Nagle (a request's headers and body go
out as two writes), the replicas' CA bundle and, when they ask for one, the router's own client
certificate (serve --ssl-ca-certs). Opened on the router's event loop at start, closed at stop."""
from __future__ import annotations

import socket
import ssl

import httpx

from polychip.errors import ConfigError
from polychip.router.settings import LiveSettings, RouterConfig


def replica_tls(cfg: RouterConfig) -> ssl.SSLContext:
    """How https replicas are checked: the CA bundle (default: the system's), and the router's own
    client certificate when the replicas ask for one (serve --ssl-ca-certs)."""
    try:
        ctx = ssl.create_default_context(cafile=cfg.replica_ca_bundle)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--replica-ca-bundle {cfg.replica_ca_bundle}: not a readable PEM CA bundle ({e})") from None
    if cfg.replica_client_cert is not None:
        try:
            ctx.load_cert_chain(cfg.replica_client_cert, cfg.replica_client_key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"--replica-client-cert {cfg.replica_client_cert} / --replica-client-key "
                              f"{cfg.replica_client_key}: not a usable certificate and key ({e})") from None
    return ctx


class ReplicaClient:
    def __init__(self, settings: LiveSettings):
        self.settings = settings
        self.http: httpx.AsyncClient | None = None

    @property
    def headers(self) -> dict:
        """The replica key as a bearer token (none without one)."""
        key = self.settings.now.replica_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    def open(self) -> httpx.AsyncClient:
        cfg = self.settings.now
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
        transport = httpx.AsyncHTTPTransport(limits=limits, verify=replica_tls(cfg),
                                             socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.http = httpx.AsyncClient(transport=transport, timeout=timeout)
        return self.http

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
