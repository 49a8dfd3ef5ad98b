"""The config dataclasses are the one source of the CLI flags, their defaults, help and choices."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from polychip.flags import add_config_args, config_from_args
from polychip.commands.serve import build_parser
from polychip.config import REASONING_PARSERS, EngineConfig, ServerConfig
from polychip.errors import ConfigError
from polychip.server.reasoning import PARSERS

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)


def parse(cls, argv):
    p = argparse.ArgumentParser()
    add_config_args(p, cls)
    return config_from_args(p.parse_args(argv), cls)


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_no_flags_give_the_dataclass_defaults(cls):
    assert parse(cls, []) == cls()


def test_every_field_has_a_flag_on_serve():
    dests = {a.dest for a in build_parser()._actions}
    for cls in (EngineConfig, ServerConfig):
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in dests]
        assert missing == [], f"{cls.__name__} fields without a serve flag: {missing}"


def test_flags_map_onto_fields():
    cfg = parse(EngineConfig, ["--dtype", "bfloat16", "--disable-fusion", "--plugin", "a.b", "--plugin", "c.py",
                               "--max-total-tokens", "4096", "--mem-fraction-static", "0.5"])
    assert (cfg.dtype, cfg.enable_fusion, cfg.plugins) == ("bfloat16", False, ("a.b", "c.py"))
    assert (cfg.max_total_tokens, cfg.mem_fraction_static) == (4096, 0.5)
    srv = parse(ServerConfig, ["--port", "8001", "--enable-metrics", "--reasoning-parser", "qwen3"])
    assert (srv.port, srv.enable_metrics, srv.reasoning_parser) == (8001, True, "qwen3")


def test_choices_come_from_the_owners():
    with pytest.raises(SystemExit):
        parse(EngineConfig, ["--dtype", "float64"])
    with pytest.raises(SystemExit):
        parse(ServerConfig, ["--reasoning-parser", "nope"])
    assert set(REASONING_PARSERS) == set(PARSERS)


@pytest.mark.parametrize("cls,kwargs,needle", [
    (EngineConfig, {"page_size": 0}, "page_size"),
    (EngineConfig, {"schedule_policy": "random"}, "schedule_policy"),
    (EngineConfig, {"mem_fraction_static": 1.5}, "mem_fraction_static"),
    (ServerConfig, {"port": 70000}, "port"),
    (ServerConfig, {"graceful_shutdown_timeout": -1}, "graceful_shutdown_timeout"),
    (ServerConfig, {"log_level": "loud"}, "log_level"),
])
def test_bad_values_name_the_field(cls, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        cls(**kwargs)


def test_unknown_keyword_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown EngineConfig argument.*'host'"):
        EngineConfig.from_kwargs(host="0.0.0.0")
