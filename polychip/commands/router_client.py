"""The client side of the router's admin API for the operator's commands (``workload``,
``telemetry``): the router URL and API key flags, and one call that turns an HTTP error into
the router's own message."""
from __future__ import annotations

import argparse
import os

import httpx

DEFAULT_URL = "http://127.0.0.1:30000"


class AdminError(Exception):
    """The router refused or could not be reached; the message is what to print."""


def add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("POLYCHIP_ROUTER_URL", DEFAULT_URL),
                   help=f"the router (env POLYCHIP_ROUTER_URL; default {DEFAULT_URL})")
    p.add_argument("--api-key", default=os.environ.get("POLYCHIP_API_KEY"), help="env POLYCHIP_API_KEY")


class Admin:
    def __init__(self, url: str, api_key: str | None, timeout: float = 60):
        self.base = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise AdminError(f"cannot reach the router at {self.base}: {e}") from None
        check(r)
        return r

    def json(self, method: str, path: str, **kw):
        return self.call(method, path, **kw).json()

    def stream_lines(self, path: str, **kw):
        """Yield the text of a streamed answer as it comes (``logs --follow``)."""
        try:
            with self.http.stream("GET", path, timeout=httpx.Timeout(None, connect=10), **kw) as r:
                if r.status_code >= 400:
                    r.read()
                    check(r)
                yield from r.iter_text()
        except httpx.HTTPError as e:
            raise AdminError(f"the stream from {self.base} broke: {e}") from None


def check(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    msg = r.text
    if r.headers.get("content-type", "").startswith("application/json"):
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
    raise AdminError(f"HTTP {r.status_code}: {msg}")
