"""`polychip bench peers` runs int8 and W8A8 rows beside the float32 one, in the same run."""
from __future__ import annotations

import json

import pytest
import torch

from polychip.bench import roofline
from polychip.commands import bench

pytestmark = pytest.mark.device_independent   # runs the default device (cpu), as the command it checks does


def test_peers_has_int8_and_w8a8_rows(model_factory, tmp_path, monkeypatch):
    small = roofline.measure_machine
    monkeypatch.setattr(roofline, "measure_machine", lambda shape, plugin=None, **kw: small(shape, 1, plugin, mib=2, **kw))
    from polychip.bench import peers
    monkeypatch.setattr(peers, "WINDOW_READ", (2, 1))
    out = tmp_path / "peers.json"
    threads = torch.get_num_threads()
    try:
        rc = bench.main(["peers", "--model-path", model_factory("llama", False), "--engines", "polychip,polychip-int8,polychip-w8a8",
                         "--input-len", "8", "--output-len", "3", "--concurrency", "2", "--decode-tokens", "2",
                         "--shared-prefix-len", "0", "--num-threads", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads(out.read_text())
    row = res["engines"]["polychip-int8"]
    assert row["engine"] == "polychip int8" and row["output_tokens"] == 6 and row["decode_tok_s"] > 0
    assert "polychip-int8" in res["ratios"]
    table = (tmp_path / "peers.md").read_text()
    assert "| polychip int8 |" in table and "its % columns are of its own int8 roofline" in table
    w8a8 = res["engines"]["polychip-w8a8"]
    assert w8a8["engine"] == "polychip w8a8" and w8a8["output_tokens"] == 6 and w8a8["pct_workload_roofline"] > 0
    assert res["machine"]["int8_gops"] > 0 and "int8 activations" in res["rooflines"]["polychip-w8a8"]["storage"]
    assert "| polychip w8a8 |" in table and "W8A8 matmul" in table and "int8 activations quantised per token" in table
    # each single stream read against its own moment; the run's read ceiling is the best read it saw
    reads = [r["single_stream_read_gbs"] for r in res["engines"].values()]
    assert len(reads) == 3 and min(reads) > 0 and res["machine"]["bandwidth_gbs"] >= max(reads)
    assert all(r["pct_decode_roofline_at_its_read"] > 0 for r in res["engines"].values())
    assert "the read the best of 8)" in table and "Single-stream decode against the read measured" in table
