"""One etcd member as this router reaches it, and what its refusals mean.

The client is etcd3gw's (etcd's JSON gateway, /v3) over a ``requests`` session set up only by the
router's settings: TLS with the CA bundle and client certificate of ``--etcd-*`` (the process's
proxy and CA-bundle environment variables are ignored: ``REQUESTS_CA_BUNDLE`` would otherwise
replace the CA given). etcd3gw has no authentication: with ``--etcd-user`` the member is asked for a
token (``/v3/auth/authenticate``, the password read from ``--etcd-password-file`` each time, so a
rotated Secret is picked up), which goes in the ``Authorization`` header as etcd's gateway expects,
and is asked again when etcd says the token expired.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client
from etcd3gw.utils import _decode

from polychip.router.state.base import StoreError

TRANSIENT = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
             etcd_errors.InternalServerError)
# what a TLS handshake failure says, and what it means for the operator
NO_CERT = "it asks for a client certificate and this router gives none (--etcd-cert, --etcd-key)"
TLS_CAUSES = (
    ("CERTIFICATE_VERIFY_FAILED", "its certificate does not chain to the CA bundle (--etcd-ca {ca})"),
    ("CERTIFICATE_REQUIRED", "it refused this router's client certificate {cert}"),
    ("BAD_CERTIFICATE", "it refused this router's client certificate {cert} (not signed by a CA it trusts)"),
    ("UNKNOWN_CA", "it refused this router's client certificate {cert} (signed by a CA it does not know)"),
    ("WRONG_VERSION_NUMBER", "it does not speak TLS: use etcd://"),
    ("UNEXPECTED_EOF", "it closed the TLS handshake: does it serve TLS? (use etcd:// if not)"),
)


def value_of(kv: dict) -> Any:
    """A stored value: JSON as the routers write it; another writer's bytes (the election's candidate
    values, a program beside us) as their text, for the typed readers to judge."""
    raw = _decode(kv.get("value", ""))
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode("utf-8", "replace")


def cause(e: BaseException) -> str:
    """The readable part of an etcd3gw or requests error (etcd3gw keeps the body in detail_text)."""
    text = getattr(e, "detail_text", None) or str(e) or type(e).__name__
    try:
        body = json.loads(text)
        text = body.get("message") or body.get("error") or text
    except (ValueError, AttributeError):
        pass
    reason = e.args[0] if isinstance(e, etcd_errors.Etcd3Exception) and e.args else None
    return f"{reason}: {text}" if reason and reason not in text else str(text)


def is_tls_failure(e: BaseException) -> bool:
    return isinstance(e, etcd_errors.ConnectionFailedError) and "SSL" in cause(e)


class Member:
    """One endpoint: ``call(fn)`` runs ``fn(client)``, authenticating first when the store needs it."""

    def __init__(self, host: str, port: int, scheme: str, access, timeout: float):
        self.where = f"{scheme}://{host}:{port}"
        self.access = access
        session = requests.Session()
        session.trust_env = False
        if scheme == "https":
            session.verify = access.ca if access is not None and access.ca else True
            if access is not None and access.cert:
                session.cert = (access.cert, access.key)
        self.client = Etcd3Client(host=host, port=port, protocol=scheme, session=session, timeout=timeout)
        self.user = access.user if access is not None else None
        self._auth_lock = threading.Lock()
        self._token: str | None = None

    @property
    def session(self) -> requests.Session:
        return self.client.session

    def call(self, fn: Callable[[Etcd3Client], Any]) -> Any:
        if self.user is not None and self._token is None:
            self.authenticate()
        try:
            return fn(self.client)
        except etcd_errors.Etcd3Exception as e:
            if self.user is None or "invalid auth token" not in cause(e):
                raise
            self.authenticate()           # the token expired (etcd's --auth-token-ttl): once more
            return fn(self.client)

    def authenticate(self) -> None:
        with self._auth_lock:
            password = read_password(self.access.password_file)
            got = self.client.post(self.client.get_url("/auth/authenticate"),
                                   json={"name": self.user, "password": password})
            self._token = got["token"]
            self.session.headers["Authorization"] = self._token

    def refusal(self, e: BaseException, what: str) -> StoreError:
        """``e`` as a StoreError naming this member, what was asked and the cause in the operator's
        terms; ``retryable`` False when asking again cannot help (a bad certificate, a wrong password,
        a request too large)."""
        text = cause(e)
        if is_tls_failure(e):
            access = self.access
            cert = getattr(access, "cert", None)
            why = next((m.format(ca=getattr(access, "ca", None) or "(the system's)", cert=cert)
                        for k, m in TLS_CAUSES if k in text.upper()), "the TLS handshake failed")
            if cert is None and "client certificate" in why:
                why = NO_CERT
            return StoreError(f"etcd at {self.where}: {why} ({text})", layer="config", retryable=False)
        if "invalid user ID or password" in text:
            return StoreError(f"etcd at {self.where}: user {self.user!r} was refused: wrong password (read "
                              f"from {self.access.password_file}) or no such user", layer="config", retryable=False)
        if "user name is empty" in text:
            return StoreError(f"etcd at {self.where} has authentication on: give --etcd-user and "
                              "--etcd-password-file", layer="config", retryable=False)
        if "permission denied" in text:
            return StoreError(f"etcd at {self.where}: user {self.user!r} may not {what} (grant its role "
                              f"read-write on the router's key prefix): {text}", layer="config")
        invalid = "too large" in text or "larger than max" in text or (
            isinstance(e, etcd_errors.Etcd3Exception) and e.args[:1] == ("Bad Request",))
        return StoreError(f"etcd at {self.where}: {what} failed: {type(e).__name__}: {text}", retryable=not invalid)


def read_password(path: str) -> str:
    """The etcd user's password: the first line of ``path`` (a mounted Secret), never a flag's value."""
    try:
        with open(path) as f:
            password = f.readline().rstrip("\r\n")
    except OSError as e:
        raise StoreError(f"--etcd-password-file {path}: cannot read it ({e.strerror})", layer="config",
                         retryable=False) from None
    if not password:
        raise StoreError(f"--etcd-password-file {path}: its first line is empty", layer="config", retryable=False)
    return password
