"""The trust flags shared by serve, verify, doctor and the router (one dataclass; the flags come
from its fields)."""
from __future__ import annotations

from dataclasses import dataclass

from polychip.config import option
from polychip.errors import ConfigError
from polychip.trust.store import ENV_VAR, TrustStore, load_store

GROUP = "trust chain (docs/packages.md)"


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

    def replica_flags(self) -> list[str]:
        """The same options as ``polychip serve`` flags, for the replicas a router launches."""
        store = self.store()
        flags = ["--trust-store", store.path] if store is not None else []
        return flags + [f"--{name.replace('_', '-')}" for name in ("allow_unsigned", "allow_downgrade",
                                                                  "allow_modified_plugin") if getattr(self, name)]

    def store(self) -> TrustStore | None:
        store = load_store(self.trust_store)
        if store is None:
            for flag in ("allow_unsigned", "allow_downgrade"):
                if getattr(self, flag):
                    raise ConfigError(f"--{flag.replace('_', '-')} overrides the trust store, and none is set "
                                      f"(--trust-store or ${ENV_VAR})")
        return store
