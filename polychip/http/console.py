"""The web console: a page built from ``console/`` (Vite; the bundle in ``polychip/console/static`` is
committed) and the routes that serve it at ``/console`` on the router and on ``polychip serve``.

The page itself is public (it holds no data); everything it shows comes from the API routes, with
the key the operator types in, sent as ``Authorization: Bearer``. The responses carry a strict
Content-Security-Policy: scripts, styles and requests only from this origin.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[1] / "console" / "static"
PATH = "/console"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
                    "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


def is_console_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


class _ConsoleFiles(StaticFiles):
    """The bundle's files with the security headers; hashed assets are cached for good."""

    async def get_response(self, path: str, scope):
        resp = await super().get_response(path, scope)
        resp.headers.update(SECURITY_HEADERS)
        if path.startswith("assets/") and resp.status_code == 200:
            resp.headers["cache-control"] = "public, max-age=31536000, immutable"
        return resp


def mount_console(app: FastAPI) -> None:
    """GET /console (and /console/) answer the page; /console/... its assets."""
    if not (STATIC / "index.html").is_file():
        raise RuntimeError(f"the console bundle is missing from {STATIC}: run `make console` "
                           "(npm ci && npm run build in console/)")

    async def index():
        return FileResponse(STATIC / "index.html", headers={**SECURITY_HEADERS, "cache-control": "no-cache"})

    for path in (PATH, PATH + "/"):
        app.add_api_route(path, index, methods=["GET"], include_in_schema=False)
    app.mount(PATH, _ConsoleFiles(directory=STATIC), name="console")
