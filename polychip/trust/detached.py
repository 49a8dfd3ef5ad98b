"""Detached signatures of the YAML files the platform reads (device specs, deployment files):
``FILE.sig`` beside ``FILE``, the same JSON as a package's ``manifest.sig`` over the file's exact
bytes (``polychip sign FILE --key K``)."""
from __future__ import annotations

import logging
import os
import time

from polychip.trust import keys as signing
from polychip.trust.store import TrustError, TrustStore, override

log = logging.getLogger("polychip.trust")

SUFFIX = ".sig"
MAX_BYTES = 16 * 2**20


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise TrustError(f"{path}: cannot read {what}: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise TrustError(f"{path}: larger than {MAX_BYTES} bytes; not a {what}")
    return data


def sign_file(path: str, key_file: str) -> str:
    """Write ``path``.sig signed by the private key ``key_file``; returns the signature's path."""
    private = signing.load_private_key(key_file)
    sig = signing.sign(_read(path, "file to sign"), private)
    out = path + SUFFIX
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(sig)
    os.replace(tmp, out)
    return out


def verify_file(path: str, store: TrustStore | None, allow_unsigned: bool = False, what: str = "file") -> str | None:
    """Check ``path`` against its ``.sig`` and the trust store: the signer's key file, or None when
    there is no store (nothing is checked) or an unsigned file is let through by ``allow_unsigned``.
    Refusals are TrustError naming the file and the key."""
    if store is None:
        return None
    t0 = time.perf_counter()
    sig_path = path + SUFFIX
    data = _read(path, what)
    if not os.path.exists(sig_path):
        msg = f"{path}: {what} is unsigned (no {os.path.basename(sig_path)}) and the trust store {store.path} is set"
        if not allow_unsigned:
            raise TrustError(f"{msg}; sign it with `polychip sign {path} --key KEY` (or --allow-unsigned)")
        override(f"{msg}: loaded by --allow-unsigned")
        return None
    try:
        signer = signing.verify(data, _read(sig_path, "signature"), store.trusted_keys(), os.path.basename(path))
    except TrustError as e:
        raise TrustError(f"{path}: {what} refused: {e.args[0]}") from None
    log.info("trust: %s %s verified: signed by %s (%.1f ms)", what, path, signer.label(),
             (time.perf_counter() - t0) * 1000)
    return signer.path
