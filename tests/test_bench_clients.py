"""GuideLLM and AIPerf, from the tool virtualenv ``make bench-tools`` builds, against ``polychip
serve``: each streams its synthetic prompts through /v1/completions, gets exactly the output
tokens it asked for, and benchmarks/third_party_clients.py reads its report."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
from conftest import make_hf_model

from polychip.http.launcher import ServerProcess

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import third_party_clients as clients  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.device_independent     # the server's API, on the cpu
if not os.path.exists(os.path.join(clients.BENCH_BIN, "guidellm")):
    pytest.skip("no .venv-bench: `make bench-tools` builds it (`make test` does)", allow_module_level=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_hf_model(str(tmp_path_factory.mktemp("clients")), "llama", tie=True)
    with ServerProcess(["--model-path", path, "--served-model-name", clients.MODEL_NAME, "--device", "cpu",
                        "--max-total-tokens", "2048"]) as s:
        yield s, path


@pytest.mark.parametrize("client", ["aiperf", "guidellm"])
def test_third_party_client_counts_what_it_asked_for(served, client, tmp_path):
    server, tokenizer = served
    load = SimpleNamespace(input_len=48, output_len=12)
    with open(tmp_path / "log.txt", "wb") as log:
        got = clients.CLIENTS[client](server.url, tokenizer, 2, 4, load, str(tmp_path), log)
    assert got["completed"] == 4, got
    assert got["output_tok_s"] > 0 and got["ttft_ms"] > 0 and got["itl_ms"] > 0, got
    if got["output_tokens"] is not None:     # AIPerf counts by re-tokenizing the streamed text: close, not equal
        assert 0.75 * 4 * 12 <= got["output_tokens"] <= 1.25 * 4 * 12, got
