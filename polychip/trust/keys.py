"""Ed25519 keys and signatures (``cryptography``): what signs a package's manifest and a YAML
file's detached signature.

A signature file is JSON: {"algorithm": "ed25519", "key_id": sha256 of the raw public key,
"signature": base64}. A package's ``manifest.sig`` signs the exact bytes of ``manifest.json``, which
lists every other file's sha256, so one signature covers the whole package; ``FILE.sig`` signs
the exact bytes of ``FILE`` (polychip/trust/detached.py).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from polychip.errors import PolychipError

ALGORITHM = "ed25519"
MANIFEST = "manifest.json"      # what a package's signature covers (polychip/package/manifest.py names it too)


class TrustError(PolychipError):
    """A file or key is refused by the trust chain: unsigned, signed by an unknown, expired or
    revoked key, changed since it was signed, a downgrade, or a modified plugin."""

    layer = "config"


@dataclass(frozen=True)
class TrustedKey:
    """A public key a signature may be checked with. ``problem`` (set by a site trust store,
    polychip/trust/store.py) says why it must not be used now: expired or revoked; ``key`` is None
    for a revoked key id whose key file the store no longer holds."""

    path: str
    key: Ed25519PublicKey | None
    problem: str = ""
    revoked_id: str = ""

    @property
    def key_id(self) -> str:
        return key_id(self.key) if self.key is not None else self.revoked_id

    def label(self) -> str:
        return f"{self.path} ({self.key_id[:16]})"


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def keygen(out: str) -> tuple[str, str]:
    """Write a new private key to ``out`` (PEM, mode 0600) and its public key to ``out.pub``."""
    pub_path = out + ".pub"
    for path in (out, pub_path):
        if os.path.exists(path):
            raise TrustError(f"{path} exists; not overwriting a key")
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(out, 0o600)                  # whatever the umask
    with open(pub_path, "xb") as f:
        f.write(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return out, pub_path


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(64 * 1024)
    except OSError as e:
        raise TrustError(f"{path}: cannot read {what}: {e.strerror}") from None


def load_private_key(path: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(_read(path, "the signing key"), password=None)
    except (ValueError, TypeError) as e:
        raise TrustError(f"{path}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise TrustError(f"{path}: an {type(key).__name__}, expected an Ed25519 key (polychip keygen)")
    return key


def load_trusted_key(path: str) -> TrustedKey:
    try:
        key = serialization.load_pem_public_key(_read(path, "the trusted key"))
    except (ValueError, TypeError) as e:
        raise TrustError(f"{path}: not a PEM public key ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise TrustError(f"{path}: an {type(key).__name__}, expected an Ed25519 public key (polychip keygen)")
    return TrustedKey(path, key)


def sign(manifest: bytes, private: Ed25519PrivateKey) -> bytes:
    doc = {"algorithm": ALGORITHM, "key_id": key_id(private.public_key()),
           "signature": base64.b64encode(private.sign(manifest)).decode("ascii")}
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def signature_key_id(sig: bytes) -> tuple[str, bytes]:
    """(key id, raw signature) from ``manifest.sig``'s bytes; TrustError(reason) if malformed."""
    try:
        doc = json.loads(sig.decode("utf-8"))
        algorithm, kid = doc["algorithm"], doc["key_id"]
        raw = base64.b64decode(doc["signature"], validate=True)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise TrustError(f"bad signature file ({type(e).__name__}: {e})") from None
    if algorithm != ALGORITHM:
        raise TrustError(f"algorithm {algorithm!r}; only {ALGORITHM} is accepted")
    if not isinstance(kid, str):
        raise TrustError("bad signature file (key_id is not a string)")
    return kid, raw


def verify(manifest: bytes, sig: bytes, trusted: list[TrustedKey], what: str = MANIFEST) -> TrustedKey:
    """The trusted key that signed ``manifest`` (the bytes of ``what``); else TrustError(reason):
    whose key, or why not."""
    kid, raw = signature_key_id(sig)
    match = sorted((t for t in trusted if t.key_id == kid), key=lambda t: not t.problem)
    if match and match[0].problem:      # revoked or expired: refused before the signature is even read
        raise TrustError(f"signed by key {match[0].label()}, which {match[0].problem}")
    if not match:
        known = ", ".join(t.label() for t in trusted if not t.problem)
        raise TrustError(f"signed by key {kid[:16]}, which is not a trusted key (trusted: {known})")
    try:
        match[0].key.verify(raw, manifest)
    except InvalidSignature:
        raise TrustError(f"bad signature: {what} does not match the signature of trusted key "
                           f"{match[0].label()}") from None
    return match[0]
