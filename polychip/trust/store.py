"""The site trust store: which keys may sign what this site loads, until when, which are revoked,
and the highest release of each model seen here (no downgrade).

A folder (or its ``trust.yaml`` named directly) given by ``--trust-store`` or ``$POLYCHIP_TRUST_STORE``::

    keys:
      - file: keys/release.pub        # Ed25519 public key (polychip keygen), relative to the store
        not_after: 2027-06-30         # the last day it verifies; required
        key_id: 3f5c...               # optional: refused unless the file's key has this id
    revoked:
      - key_id: 9a1b...               # sha256 of the raw public key (polychip keygen prints it)
        reason: laptop lost 2026-11-02

``releases.json`` beside ``trust.yaml`` (polychip/trust/releases.py) is the one file of the store the
serving user writes: the folder, ``trust.yaml`` and the keys can stay read-only to it. A store
that anyone may write (``trust.yaml``, its folder or a key file writable by others) is refused.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import re
import stat
from dataclasses import dataclass, field

from polychip.errors import ConfigError, PolychipError
from polychip.trust import keys as signing
from polychip.trust.keys import TrustError
from polychip.trust.releases import RELEASES_FILE, Releases
from polychip.yaml_file import read_yaml_file

log = logging.getLogger("polychip.trust")

ENV_VAR = "POLYCHIP_TRUST_STORE"
STORE_FILE = "trust.yaml"
_KEY_ID = re.compile(r"[0-9a-f]{64}")


def override(message: str) -> None:
    """An --allow-* flag let something through that the trust store would refuse: said loudly."""
    log.warning("TRUST OVERRIDE: %s", message)


def check_not_writable_by_others(path: str, what: str) -> None:
    """Refuse a file or folder of the store that any user may write (mode o+w)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what} ({e})") from None
    if mode & stat.S_IWOTH:
        raise ConfigError(f"{path}: the {what} is writable by every user (mode {stat.filemode(mode)}); a trust "
                          f"store must be writable only by its owner (chmod o-w)")


def _date(value, where: str) -> datetime.date:
    if isinstance(value, datetime.datetime):
        return value.date()
    if isinstance(value, datetime.date):
        return value
    try:
        return datetime.date.fromisoformat(str(value))
    except ValueError:
        raise ConfigError(f"{where}: not_after must be a date YYYY-MM-DD, got {value!r}") from None


@dataclass(frozen=True)
class StoreKey:
    key: signing.TrustedKey
    not_after: datetime.date


@dataclass
class TrustStore:
    path: str                                          # trust.yaml
    keys: list[StoreKey] = field(default_factory=list)
    revoked: dict[str, str] = field(default_factory=dict)    # key id -> reason

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path)

    @classmethod
    def load(cls, where: str) -> "TrustStore":
        path = os.path.join(where, STORE_FILE) if os.path.isdir(where) else where
        for where, what in ((path, "trust store"), (os.path.dirname(os.path.abspath(path)), "trust store's folder")):
            if os.path.exists(where):
                check_not_writable_by_others(where, what)
        doc = read_yaml_file(path, "trust store", "a mapping with a non-empty 'keys' list", ConfigError)
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list) or not doc["keys"]:
            raise ConfigError(f"{path}: expected a mapping with a non-empty 'keys' list (see docs/packages.md)")
        store = cls(os.path.abspath(path))
        for i, entry in enumerate(doc.get("revoked") or []):
            if not isinstance(entry, dict) or not _KEY_ID.fullmatch(str(entry.get("key_id", ""))):
                raise ConfigError(f"{path}: revoked[{i}] needs key_id: the 64 hex digits of the key's id")
            store.revoked[entry["key_id"]] = str(entry.get("reason") or "no reason given")
        for i, entry in enumerate(doc["keys"]):
            store.keys.append(store._key(entry, f"{path}: keys[{i}]"))
        return store

    def _key(self, entry, where: str) -> StoreKey:
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or "not_after" not in entry:
            raise ConfigError(f"{where}: needs file (a public key) and not_after (a date)")
        file = os.path.join(self.folder, entry["file"])
        if os.path.exists(file):
            check_not_writable_by_others(file, "trusted key")
        try:
            key = signing.load_trusted_key(file)
        except PolychipError as e:
            raise ConfigError(f"{where}: {e.args[0]}") from None
        if entry.get("key_id") not in (None, key.key_id):
            raise ConfigError(f"{where}: {file} has key id {key.key_id}, the store says {entry['key_id']}")
        return StoreKey(key, _date(entry["not_after"], where))

    def trusted_keys(self, today: datetime.date | None = None) -> list[signing.TrustedKey]:
        """Every key, each marked with why it must not be used today (expired, revoked), plus the
        revoked ids whose key file is gone: signing.verify refuses those by name."""
        today = today or datetime.date.today()
        out = []
        for k in self.keys:
            problem = ""
            if k.key.key_id in self.revoked:
                problem = f"is revoked in the trust store {self.path} ({self.revoked[k.key.key_id]})"
            elif today > k.not_after:
                problem = f"expired on {k.not_after} (not_after in the trust store {self.path})"
            out.append(signing.TrustedKey(k.key.path, k.key.key, problem))
        present = {k.key.key_id for k in self.keys}
        out += [signing.TrustedKey(self.path, None, f"is revoked in the trust store {self.path} ({why})", kid)
                for kid, why in self.revoked.items() if kid not in present]
        return out

    def expiring(self, days: int, today: datetime.date | None = None) -> list[StoreKey]:
        today = today or datetime.date.today()
        return [k for k in self.keys if k.key.key_id not in self.revoked and today <= k.not_after
                and (k.not_after - today).days < days]

    # releases: no downgrade
    def releases(self) -> dict:
        return Releases(self.folder).read()

    def check_release(self, name: str, number: int, source: str, allow_downgrade: bool) -> None:
        seen = self.releases().get(name)
        if seen is None or number >= seen["release"]:
            return
        msg = (f"{source}: release {number} of {name!r} is older than release {seen['release']} already "
               f"loaded here ({seen['package']}, {seen['seen']}; {os.path.join(self.folder, RELEASES_FILE)})")
        if not allow_downgrade:
            raise TrustError(f"{msg}: a downgrade is refused (--allow-downgrade to load it anyway)")
        override(f"{msg}: loaded by --allow-downgrade")

    def record_release(self, name: str, number: int, manifest_sha256: str, package: str) -> None:
        """Remember ``number`` if it is the highest of ``name`` (under a lock, in place)."""
        if Releases(self.folder).record(name, number, manifest_sha256, package):
            log.info("trust: release %d of %r recorded in %s", number, name, self.folder)


def store_path(explicit: str | None) -> str | None:
    return explicit or os.environ.get(ENV_VAR) or None


def load_store(explicit: str | None) -> TrustStore | None:
    """The trust store named by the flag, else the environment; None when the site has none."""
    where = store_path(explicit)
    return TrustStore.load(where) if where else None
