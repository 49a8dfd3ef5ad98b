"""``polychip.LLM``: the offline API behind the same trust chain as ``serve`` and ``generate``.

Beside the engine's keyword arguments it takes the trust and package options by their field
names (``trust_store``, ``allow_unsigned``, ``allow_downgrade``, ``allow_modified_plugin``,
``trusted_keys``, ``require_signature``, ``strict_versions``). With a trust store (the argument
or ``$POLYCHIP_TRUST_STORE``) the model must be a package signed by one of its keys, and a device
spec must be signed too; a ``.pcpkg`` is verified and extracted before anything of it loads.
``polychip.engine.llm.LLM.from_config`` is the engine's own entry, for a config already checked.
"""
from __future__ import annotations

from dataclasses import fields

from polychip.config import EngineConfig
from polychip.engine import llm as engine_llm
from polychip.package.opening import engine_config_for
from polychip.trust.options import PackageOptions, TrustOptions

TRUST_ARGS = frozenset(f.name for f in fields(TrustOptions))
PACKAGE_ARGS = frozenset(f.name for f in fields(PackageOptions))


def checked_config(model_path: str | None, kwargs: dict) -> EngineConfig:
    """The engine config of ``LLM(model_path, **kwargs)`` after the trust chain: the trust and
    package arguments are taken out of ``kwargs``, the rest are the engine's."""
    engine_args = dict(kwargs)
    trust = TrustOptions(**{k: engine_args.pop(k) for k in TRUST_ARGS & kwargs.keys()})
    package = {k: engine_args.pop(k) for k in PACKAGE_ARGS & kwargs.keys()}
    if "trusted_keys" in package:
        package["trusted_keys"] = tuple(package["trusted_keys"])
    config = EngineConfig.from_kwargs(model_path=model_path, **engine_args)
    return engine_config_for(config, PackageOptions(**package), trust)


class LLM(engine_llm.LLM):
    def __init__(self, model_path: str | None = None, **kwargs):
        self._start(checked_config(model_path, kwargs))
