"""Open a package for the engine: verify the manifest and its signature, check the device and
the version matrix, then extract into a cache keyed by the manifest's sha256 (verifying every
file while streaming). A second start finds the folder and re-hashes it instead of extracting.

``serve``, ``generate`` and ``batch`` call :func:`engine_config_for` before the engine exists; Python
code uses ``polychip.LLM`` (polychip/package/trusted_llm.py), which does the same.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field

from polychip.config import EngineConfig
from polychip.errors import ConfigError
from polychip.trust import keys as signing
from polychip.package.compat import check_target
from polychip.package.hashing import copy_hashing
from polychip.package.manifest import SUFFIX, PackageError
from polychip.package.reader import scan
from polychip.trust.options import PackageOptions, TrustOptions
from polychip.trust.pins import check_pin
from polychip.trust.detached import verify_file
from polychip.trust.store import TrustError, override

log = logging.getLogger("polychip.package")


def is_package(model_path: str | None) -> bool:
    return bool(model_path) and model_path.endswith(SUFFIX) and os.path.isfile(model_path)


@dataclass
class OpenedPackage:
    path: str
    model_dir: str
    manifest: dict
    manifest_sha256: str
    signer: str | None                      # the trusted key file that signed it, if checked
    extracted: bool                         # False: found in the cache (and re-verified)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    costs: dict[str, float] = field(default_factory=dict)   # seconds of each check (see check_trust)


def cache_root(cache_dir: str | None) -> str:
    root = cache_dir or os.environ.get("POLYCHIP_CACHE") or os.path.expanduser("~/.cache/polychip")
    return os.path.join(root, "packages")


def cached_problem(folder: str, manifest: dict) -> str:
    """Why an extracted folder no longer matches its manifest ("" when every file does)."""
    listed = {f["name"]: f for f in manifest["files"]}
    present = set(os.listdir(folder))
    if present != set(listed):
        return f"files differ: extra {sorted(present - set(listed))}, missing {sorted(set(listed) - present)}"
    for name, entry in listed.items():
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            return f"{name}: {e.strerror}"
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return f"{name}: not a regular file"
            digest, size = copy_hashing(f)
        if (digest, size) != (entry["sha256"], entry["size"]):
            return f"{name}: hash mismatch"
    return ""


def extract(path: str, verify: "_Verify", cache_dir: str | None, manifest: dict, sha: str) -> tuple[str, bool]:
    """(folder, extracted now) for a package whose head has verified."""
    root = cache_root(cache_dir)
    final = os.path.join(root, sha)
    if os.path.isdir(final):
        why = cached_problem(final, manifest)
        if not why:
            return final, False
        log.warning("%s: the cached extraction %s no longer matches the manifest (%s); extracting again",
                    path, final, why)
        shutil.rmtree(final, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{sha[:16]}.extract-", dir=root)
    try:
        res = scan(path, verify.trusted, verify.require, out_dir=tmp, allow_unsigned=verify.allow_unsigned)
        if res.manifest_sha256 != sha:
            raise PackageError(f"{path}: the package changed while it was opened (manifest sha256 "
                               f"{res.manifest_sha256[:16]}, was {sha[:16]})")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:       # another process finished the same extraction first
            if cached_problem(final, manifest):
                raise
        return final, True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class _Verify:
    """What a package's signature is checked with: --trusted-key files and the site trust store."""

    trusted: list
    require: bool
    allow_unsigned: bool
    store: object = None

    @classmethod
    def of(cls, options: PackageOptions, trust: TrustOptions) -> "_Verify":
        store = trust.store()
        trusted = [signing.load_trusted_key(k) for k in options.trusted_keys]
        if store is not None:
            trusted += store.trusted_keys()
        return cls(trusted, options.require_signature or store is not None,
                   store is not None and trust.allow_unsigned, store)


def check_trust(head, verify: _Verify, trust: TrustOptions, plugin, path: str, costs: dict) -> None:
    """After the signature: the release number against the trust store (no downgrade) and the
    installed plugin against the package's pin. Each check's seconds go into ``costs``."""
    manifest = head.manifest
    if verify.store is not None and head.signer is None:
        override(f"{path}: UNSIGNED package loaded although the trust store {verify.store.path} is set "
                 "(--allow-unsigned)")
    release = manifest.get("release")
    if verify.store is not None:
        t0 = time.perf_counter()
        if release is None:
            log.warning("%s: carries no release number; the trust store cannot refuse a downgrade of it", path)
        else:
            verify.store.check_release(release["name"], release["number"], path, trust.allow_downgrade)
        costs["release"] = time.perf_counter() - t0
    if plugin is not None:
        if manifest.get("plugin_pin") is None:
            log.warning("%s: pins no plugin files (packed before plugin pins); the plugin is not checked", path)
        costs["plugin_pin"] = check_pin(manifest.get("plugin_pin"), plugin, path, trust.allow_modified_plugin)


def open_package(path: str, options: PackageOptions = PackageOptions(), cache_dir: str | None = None,
                 plugin=None, trust: TrustOptions = TrustOptions()) -> OpenedPackage:
    """Verify (signature per ``options`` and the trust store, release number, plugin pin, device
    type, API and versions when ``plugin`` is given, every file's hash) and extract; nothing of the
    model is loaded here."""
    t0 = time.perf_counter()
    costs = {}
    verify = _Verify.of(options, trust)
    head = scan(path, verify.trusted, verify.require, head_only=True, allow_unsigned=verify.allow_unsigned)
    costs["signature"] = time.perf_counter() - t0
    check_trust(head, verify, trust, plugin, path, costs)
    warnings = []
    if plugin is not None:
        warnings = check_target(head.manifest, plugin, options.strict_versions, path)
        for w in warnings:
            log.warning("%s: version mismatch: %s", path, w)
    t1 = time.perf_counter()
    folder, extracted = extract(path, verify, cache_dir, head.manifest, head.manifest_sha256)
    costs["files"] = time.perf_counter() - t1
    release = head.manifest.get("release")
    if verify.store is not None and release is not None:
        verify.store.record_release(release["name"], release["number"], head.manifest_sha256, path)
    opened = OpenedPackage(path, folder, head.manifest, head.manifest_sha256,
                           head.signer.path if head.signer else None, extracted, warnings, time.perf_counter() - t0,
                           costs)
    log.info("package %s: %s %s in %.2fs (manifest %s%s; %s)", path, "verified and extracted to" if extracted else
             "verified in the cache at", folder, opened.seconds, opened.manifest_sha256[:16],
             f", signed by {opened.signer}" if opened.signer else ", signature not checked",
             ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in costs.items()))
    return opened


def engine_config_for(config: EngineConfig, options: PackageOptions,
                      trust: TrustOptions = TrustOptions()) -> EngineConfig:
    """``config`` with its device spec checked against the trust store, and a package
    ``model_path`` replaced by its verified, extracted folder (the device is opened once to check
    the package against it, then closed). With a trust store, a model that is not a package is
    unsigned: refused unless ``trust.allow_unsigned``."""
    store = trust.store()
    if config.device_config:
        verify_file(config.device_config, store, trust.allow_unsigned, "device spec")
    if not is_package(config.model_path):
        if options.trusted_keys or options.require_signature or options.strict_versions:
            raise ConfigError(f"--trusted-key, --require-signature and --strict-versions apply to {SUFFIX} "
                              f"packages; {config.model_path or 'the default model'} is not one")
        if store is not None:
            msg = (f"{config.model_path or 'the default model'}: not a signed {SUFFIX} package, and the trust "
                   f"store {store.path} is set")
            if not trust.allow_unsigned:
                raise TrustError(msg + "; pack and sign it (polychip pack --sign-key), or --allow-unsigned")
            override(msg + ": loaded by --allow-unsigned")
        return config
    from polychip.devices.discovery import open_from_config
    plugin = open_from_config(config)
    try:
        opened = open_package(config.model_path, options, config.cache_dir, plugin, trust)
    finally:
        plugin.destroy()
    name = config.served_model_name or os.path.basename(config.model_path).removesuffix(SUFFIX)
    return dataclasses.replace(config, model_path=opened.model_dir, served_model_name=name)


def open_llm(path: str, trusted_keys: tuple[str, ...] = (), require_signature: bool = False,
             strict_versions: bool = False, **engine_args):
    """``LLM`` on a package: verified and extracted first (``polychip.LLM`` does the same)."""
    from polychip.engine.llm import LLM
    options = PackageOptions(tuple(trusted_keys), require_signature, strict_versions)
    return LLM.from_config(engine_config_for(EngineConfig.from_kwargs(model_path=path, **engine_args), options))
