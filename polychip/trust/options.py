"""The trust flags (dataclasses; the flags come from their fields): ``TrustOptions`` shared by serve,
generate, batch, verify, doctor and the router; ``PackageOptions`` for a ``.pcpkg`` model; and
``RouterTrust``, the router's, which also says which trust-sensitive serve settings the replicas it
launches may be given by a workload (``GUARDED``)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from polychip.config import option
from polychip.errors import ConfigError
from polychip.flags import flag_of
from polychip.trust.store import ENV_VAR, TrustStore, load_store

GROUP = "trust chain (docs/packages.md)"
PACKAGE_GROUP = "packages (--model-path x.pcpkg)"


@dataclass(frozen=True)
class TrustOptions:
    trust_store: str | None = option(
        None, f"site trust store (a folder with trust.yaml, or the file; default ${ENV_VAR}): once set, "
              "packages, device specs and deployment files must be signed by one of its keys", group=GROUP)
    allow_unsigned: bool = option(False, "load unsigned packages and files although a trust store is set "
                                         "(logged as a TRUST OVERRIDE)", group=GROUP)
    allow_downgrade: bool = option(False, "load a package release older than one already loaded here "
                                          "(logged as a TRUST OVERRIDE)", group=GROUP)
    allow_modified_plugin: bool = option(False, "warn instead of refusing when the installed plugin's files "
                                                "differ from the package's pin (logged as a TRUST OVERRIDE)",
                                         group=GROUP)

    def replica_values(self) -> dict:
        """The same options as serve settings (field -> value), for the replicas a router launches:
        the store resolved (flag or environment), and each override that is on."""
        store = self.store()
        out = {"trust_store": store.path} if store is not None else {}
        return out | {name: True for name in ("allow_unsigned", "allow_downgrade", "allow_modified_plugin")
                      if getattr(self, name)}

    def store(self) -> TrustStore | None:
        store = load_store(self.trust_store)
        if store is None:
            for flag in ("allow_unsigned", "allow_downgrade"):
                if getattr(self, flag):
                    raise ConfigError(f"--{flag.replace('_', '-')} overrides the trust store, and none is set "
                                      f"(--trust-store or ${ENV_VAR})")
        return store


@dataclass(frozen=True)
class PackageOptions:
    """How a package (``--model-path x.pcpkg``) is trusted; the flags come from these fields.
    Trusted keys (or ``require_signature``) make a valid signature by one of them a condition of
    loading; hashes are always checked."""

    trusted_keys: tuple[str, ...] = option(
        (), "Ed25519 public key (polychip keygen) a package must be signed by (repeatable); the recommended "
            "way to load packages", group=PACKAGE_GROUP, flag="--trusted-key")
    require_signature: bool = option(False, "refuse a package that is not signed by a --trusted-key",
                                     group=PACKAGE_GROUP)
    strict_versions: bool = option(False, "refuse a package built for other plugin/driver/runtime/collective/"
                                          "firmware versions (default: warn naming each)", group=PACKAGE_GROUP)

    def __post_init__(self):
        if not isinstance(self.trusted_keys, tuple):
            raise ConfigError("trusted_keys must be a tuple of public key files")
        if self.require_signature and not self.trusted_keys:
            raise ConfigError("--require-signature needs at least one --trusted-key to check the signature with")


# serve settings that load code or weaken the trust chain, by field name: a replica the router
# launches (a workload, a deployment replica) gets none of them unless the router's
# --allow-workload-flag names it; the router's own trust settings are applied after the rest
GUARDED = {
    "plugins": "loads code into the replica",
    "trust_store": "replaces the site trust store",
    "trusted_keys": "adds a key that packages may be signed with",
    "allow_unsigned": "loads unsigned packages and files",
    "allow_downgrade": "loads an older release of a package",
    "allow_modified_plugin": "loads a plugin that differs from its package's pin",
}
_FLAGS = {f.name: flag_of(f) for cls in (TrustOptions, PackageOptions) for f in fields(cls)} | {"plugins": "--plugin"}
GUARDED_NAMES = tuple(_FLAGS[name].removeprefix("--") for name in GUARDED)     # plugin, trust-store, ...


@dataclass(frozen=True)
class RouterTrust(TrustOptions):
    """The router's trust options: the store its deployment file and its replicas are checked
    against, and which guarded serve settings a workload may still give its replica."""

    allow_workload_flags: tuple[str, ...] = option(
        (), "a serve flag that loads code or weakens the trust chain which workload specs and deployment "
            "replicas may still give their replica (repeatable; default: none, refused naming the field)",
        group=GROUP, flag="--allow-workload-flag", choices=GUARDED_NAMES)

    def __post_init__(self):
        unknown = sorted(set(self.allow_workload_flags) - set(GUARDED_NAMES))
        if unknown:
            raise ConfigError(f"--allow-workload-flag: {unknown} are not guarded serve flags; expected some of "
                              f"{list(GUARDED_NAMES)}")

    @classmethod
    def of(cls, trust: TrustOptions | None) -> "RouterTrust":
        """``trust`` as the router's (a plain TrustOptions allows no guarded setting)."""
        if isinstance(trust, RouterTrust):
            return trust
        return cls(**vars(trust)) if trust is not None else cls()

    def refusals(self, values: dict, where: str) -> list[str]:
        """One line per guarded setting in ``values`` (serve settings, field -> value) that this
        router does not allow; ``where`` names the field they came from (e.g. serve_args)."""
        return [f"{where}: {_FLAGS[name]} {why}; refused unless the router runs with "
                f"--allow-workload-flag {_FLAGS[name].removeprefix('--')}"
                for name, why in GUARDED.items()
                if values.get(name) not in (None, False, ()) and _FLAGS[name].removeprefix("--") not in self.allow_workload_flags]
