"""The tensor-parallel shared secret: a rank proves it knows it at the rendezvous (an HMAC of
rank 0's challenge, rank 0 answers in kind), so a process that merely reaches --dist-init-addr
cannot join the world. The secret itself never travels.

Given by ``--dist-secret``, ``--dist-secret-file`` or ``$POLYCHIP_DIST_SECRET`` (how rank 0 hands it
to the worker processes it starts: never on a command line). One host with none given: rank 0
makes a random one for its own workers."""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from polychip.errors import ConfigError

ENV_VAR = "POLYCHIP_DIST_SECRET"


def resolve(secret: str | None, secret_file: str | None) -> bytes | None:
    """The secret from the flag, the file or the environment; None when none is set."""
    if secret is not None and secret_file is not None:
        raise ConfigError("give --dist-secret or --dist-secret-file, not both")
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                value = f.read(4096).strip()
        except OSError as e:
            raise ConfigError(f"--dist-secret-file {secret_file}: cannot read: {e.strerror}") from None
        if not value:
            raise ConfigError(f"--dist-secret-file {secret_file}: the file is empty")
        return value
    value = secret if secret is not None else os.environ.get(ENV_VAR)
    if value is not None and not value.strip():
        raise ConfigError("the tensor-parallel secret is empty")
    return value.strip().encode() if value is not None else None


def random_secret() -> bytes:
    return secrets.token_hex(32).encode()


def proof(secret: bytes | None, who: int, challenge: str, nonce: str) -> str:
    """What rank ``who`` sends to show it knows ``secret`` ("" without one: it cannot)."""
    if secret is None:
        return ""
    return hmac.new(secret, f"rank {who}|{challenge}|{nonce}".encode(), hashlib.sha256).hexdigest()


def proves(secret: bytes | None, who: int, challenge: str, nonce: str, claimed: str) -> bool:
    """Whether ``claimed`` is rank ``who``'s proof; with no secret on this side, anything is."""
    return secret is None or hmac.compare_digest(proof(secret, who, challenge, nonce), claimed)
