"""The flags of ``polychip serve`` (SGLang's names), shared by ``serve`` and ``serve --dp-size``
(``serve_dp``), so neither command imports the other."""
from __future__ import annotations

import argparse

from polychip.commands.common import add_engine_args
from polychip.commands.options import add_config_args
from polychip.config import ServerConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polychip serve", description="polychip serve: the OpenAI-compatible HTTP "
                                "server (SGLang's flag names)")
    add_engine_args(p)
    add_config_args(p, ServerConfig)
    p.add_argument("--dp-size", type=int, default=None, help="N replicas behind a router (polychip router)")
    from polychip.package.opening import PackageOptions
    from polychip.trust.options import TrustOptions
    add_config_args(p, PackageOptions)
    add_config_args(p, TrustOptions)
    return p
