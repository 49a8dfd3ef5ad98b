"""The tensor-parallel rendezvous secret: a rank that does not know it is refused and named on
both sides; the secret never appears on a worker's command line."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_tp_engine import finish, free_port, node

from polychip import LLM
from polychip.config import EngineConfig
from polychip.distributed import secret as dist_secret
from polychip.engine.rank_workers import worker_command
from polychip.errors import ConfigError

pytestmark = pytest.mark.device_independent


def _secret_file(tmp_path, name: str, value: str) -> str:
    path = tmp_path / name
    path.write_text(value + "\n")
    return str(path)


def test_a_node_with_the_wrong_secret_is_refused_by_name(model_factory, tmp_path):
    path = model_factory("llama", False)
    port = free_port()
    other = node(path, port, "--dist-secret-file", _secret_file(tmp_path, "wrong", "not-the-secret"),
                 "--dist-init-timeout", "30")
    try:
        with pytest.raises(ConfigError, match=r"rank 1 \(node 1\) was refused: it does not know the "
                                              r"tensor-parallel secret"):
            LLM(path, device="cpu", tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}", dist_init_timeout=30,
                max_total_tokens=1024, dtype="float32", dist_secret_file=_secret_file(tmp_path, "right", "s3cret"))
        code, out = finish(other, 30)
        assert code == 1 and "rank 1 (node 1) was refused: it does not know the tensor-parallel secret" in out, out
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_the_secret_stays_off_the_worker_command_line():
    config = EngineConfig(dist_secret="s3cret-value")
    cmd = worker_command(config, 1, "cpu:1", "127.0.0.1", 5000)
    assert not any("s3cret-value" in part for part in cmd)
    assert json.loads(cmd[cmd.index("--config") + 1])["dist_secret"] is None


def test_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(dist_secret.ENV_VAR, raising=False)
    assert dist_secret.resolve(None, None) is None
    assert dist_secret.resolve(None, _secret_file(tmp_path, "s", "abc")) == b"abc"
    monkeypatch.setenv(dist_secret.ENV_VAR, "fromenv")
    assert dist_secret.resolve(None, None) == b"fromenv"
    with pytest.raises(ConfigError, match="not both"):
        dist_secret.resolve("a", _secret_file(tmp_path, "t", "b"))
    with pytest.raises(ConfigError, match="the file is empty"):
        dist_secret.resolve(None, _secret_file(tmp_path, "e", ""))
    assert dataclasses.replace(EngineConfig(), dist_secret="x").dist_secret == "x"
