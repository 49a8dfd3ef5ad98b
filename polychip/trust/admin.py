"""Writing a site trust store (``polychip trust init|add-key|revoke``): the ``trust.yaml`` that
``TrustStore.load`` reads, with the public keys copied into its ``keys/`` folder.

The folder, ``trust.yaml`` and the keys are written 0755/0644 by whoever runs the command (an
administrator); ``releases.json`` is created empty and, given ``serving_user``, handed to that user,
the one file of the store it writes (polychip/trust/releases.py). Every change is written to a
temporary file and renamed, then the store is read back with ``TrustStore.load``, so a change the
reader would refuse is never left in place.
"""
from __future__ import annotations

import datetime
import os
import shutil
import tempfile

import yaml

from polychip.errors import ConfigError
from polychip.trust import keys as signing
from polychip.trust.releases import MODE, RELEASES_FILE
from polychip.trust.store import STORE_FILE, TrustStore, _KEY_ID
from polychip.yaml_file import read_yaml_file

KEYS_DIR = "keys"
DEFAULT_DAYS = 365


def _not_after(value: datetime.date | None) -> datetime.date:
    return value or datetime.date.today() + datetime.timedelta(days=DEFAULT_DAYS)


def _write_doc(folder: str, doc: dict) -> TrustStore:
    path = os.path.join(folder, STORE_FILE)
    fd, tmp = tempfile.mkstemp(prefix=".trust.", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        os.chmod(tmp, 0o644)
        previous = open(path, "rb").read() if os.path.exists(path) else None
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        return TrustStore.load(folder)
    except ConfigError:
        if previous is None:
            os.unlink(path)
        else:
            with open(path, "wb") as f:
                f.write(previous)
        raise


def _copy_key(folder: str, public_key: str, doc: dict) -> dict:
    """Copy ``public_key`` into the store; its entry (file relative to the store, key_id)."""
    key = signing.load_trusted_key(public_key)              # an Ed25519 public key, or a clear error
    present = {e.get("key_id") for e in doc.get("keys") or [] if isinstance(e, dict)}
    if key.key_id in present:
        raise ConfigError(f"{public_key}: key {key.key_id[:16]} is already in the trust store {folder}")
    keys = os.path.join(folder, KEYS_DIR)
    os.makedirs(keys, mode=0o755, exist_ok=True)
    name = os.path.basename(public_key)
    if os.path.exists(os.path.join(keys, name)):
        name = f"{key.key_id[:16]}-{name}"
    dest = os.path.join(keys, name)
    shutil.copyfile(public_key, dest)
    os.chmod(dest, 0o644)
    return {"file": f"{KEYS_DIR}/{name}", "key_id": key.key_id}


def init(folder: str, public_key: str, not_after: datetime.date | None = None,
         serving_user: str | None = None) -> TrustStore:
    """A new store in ``folder`` trusting ``public_key`` until ``not_after`` (default: a year)."""
    if os.path.exists(os.path.join(folder, STORE_FILE)):
        raise ConfigError(f"{folder}: already holds a {STORE_FILE}; use `polychip trust add-key` or `revoke`")
    os.makedirs(folder, mode=0o755, exist_ok=True)
    os.chmod(folder, 0o755)
    entry = _copy_key(folder, public_key, {})
    store = _write_doc(folder, {"keys": [{**entry, "not_after": _not_after(not_after)}], "revoked": []})
    releases = os.path.join(folder, RELEASES_FILE)
    if not os.path.exists(releases):
        with open(os.open(releases, os.O_WRONLY | os.O_CREAT | os.O_EXCL, MODE), "w") as f:
            f.write("{}\n")
        os.chmod(releases, MODE)
    if serving_user is not None:
        try:
            shutil.chown(releases, user=serving_user)
        except (LookupError, PermissionError) as e:
            raise ConfigError(f"--serving-user {serving_user}: cannot give {releases} to that user ({e})") from None
    return store


def _doc(folder: str) -> dict:
    path = os.path.join(folder, STORE_FILE)
    TrustStore.load(folder)                                     # a store the reader accepts, before a change
    return read_yaml_file(path, "trust store", "a mapping with a non-empty 'keys' list", ConfigError)


def add_key(folder: str, public_key: str, not_after: datetime.date | None = None) -> TrustStore:
    doc = _doc(folder)
    entry = _copy_key(folder, public_key, doc)
    doc["keys"].append({**entry, "not_after": _not_after(not_after)})
    return _write_doc(folder, doc)


def revoke(folder: str, key_id: str, reason: str) -> TrustStore:
    """Revoke a key by its id (64 hex digits, or a key file whose id is taken)."""
    if os.path.isfile(key_id):
        key_id = signing.load_trusted_key(key_id).key_id
    if not _KEY_ID.fullmatch(key_id):
        raise ConfigError(f"revoke: {key_id!r} is neither a key id (64 hex digits) nor a public key file")
    doc = _doc(folder)
    doc["revoked"] = list(doc.get("revoked") or [])
    if any(isinstance(e, dict) and e.get("key_id") == key_id for e in doc["revoked"]):
        raise ConfigError(f"revoke: key {key_id[:16]} is already revoked in {folder}")
    doc["revoked"].append({"key_id": key_id, "reason": reason})
    return _write_doc(folder, doc)
