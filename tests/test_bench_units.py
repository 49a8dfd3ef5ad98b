"""Bench units: statistics, datasets, compare thresholds, metric parsing, roofline arithmetic."""
import dataclasses
import json
import math

import pytest

from polychip.bench import compare, datasets, roofline, stage_metrics, stats

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)


class WordTokenizer:
    """'w12 w7' <-> [12, 7]: one token per word, enough to check exact prompt lengths."""
    vocab_size = 1000

    def encode(self, text, add_special_tokens=True):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert stats.percentile(xs, 50) == 3.0
    assert stats.percentile(xs, 0) == 1.0 and stats.percentile(xs, 100) == 5.0
    assert stats.percentile(xs, 95) == pytest.approx(4.8)
    assert math.isnan(stats.percentile([], 50))
    d = stats.distribution([1.0, 2.0, 3.0, 4.0])
    assert d["mean"] == 2.5 and d["p50"] == 2.5 and d["p99"] == pytest.approx(3.97)


def test_summarize_counts_errors_and_throughput():
    ok = stats.RequestResult(prompt_len=10, output_len=5, ttft=0.5, latency=1.5, itl=[0.25] * 4)
    bad = stats.RequestResult(prompt_len=10, error="HTTP 500")
    s = stats.summarize([ok, ok, bad], duration=2.0, concurrency=2)
    assert s["errors"] == 1 and s["completed"] == 2
    assert s["output_throughput"] == 5.0 and s["total_throughput"] == 15.0 and s["request_throughput"] == 1.0
    assert s["ttft_ms"]["p50"] == 500 and s["tpot_ms"]["mean"] == 250 and s["itl_ms"]["p99"] == 250
    assert s["error_samples"] == ["HTTP 500"]
    assert ok.tpot == 0.25 and stats.RequestResult(1, 1, 0.1, 0.2).tpot is None


def test_synthetic_prompts_have_exact_length_and_shared_prefix():
    tok = WordTokenizer()
    reqs = datasets.synthetic(tok, 4, 50, 7, seed=1, shared_prefix_len=30)
    assert [r.prompt_len for r in reqs] == [50] * 4 and all(r.output_len == 7 for r in reqs)
    heads = {tuple(tok.encode(r.prompt)[:30]) for r in reqs}
    tails = {tuple(tok.encode(r.prompt)[30:]) for r in reqs}
    assert len(heads) == 1 and len(tails) == 4
    assert datasets.synthetic(tok, 2, 20, 4, seed=3)[0].prompt == datasets.synthetic(tok, 2, 20, 4, seed=3)[0].prompt
    with pytest.raises(ValueError):
        datasets.synthetic(tok, 1, 10, 4, shared_prefix_len=11)


def test_sharegpt_like_reads_conversations_and_caps_lengths(tmp_path):
    tok = WordTokenizer()
    recs = [{"conversations": [{"from": "human", "value": "w1 w2 w3"}, {"from": "gpt", "value": "w4 " * 40}]},
            {"conversations": [{"from": "gpt", "value": "w1"}]},                        # no user turn: skipped
            {"messages": [{"role": "user", "content": "w9 " * 99}, {"role": "assistant", "content": "w1"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(recs))
    reqs = datasets.sharegpt_like(tok, str(path), 10, max_input_len=20, max_output_len=16)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(3, 16)]
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "w1 w2", "completion": "w3 w4 w5 w6 w7"}) + "\n")
    assert [(r.prompt_len, r.output_len) for r in datasets.sharegpt_like(tok, str(jl), 5, 10, 100)] == [(2, 5)]
    with pytest.raises(ValueError):
        datasets.sharegpt_like(tok, str(path), 10, max_input_len=1, max_output_len=16)


def _result(tput, ttft, errors=0, conc=4):
    d = stats.distribution
    return {"steps": [{"concurrency": conc, "output_throughput": tput, "request_throughput": tput / 10,
                       "total_throughput": tput * 2, "ttft_ms": d([ttft]), "tpot_ms": d([10.0]),
                       "itl_ms": d([10.0]), "errors": errors}]}


def test_compare_flags_only_changes_beyond_threshold_in_the_bad_direction():
    old = _result(100.0, 200.0)
    flagged = lambda new, t=0.10: {c.metric for c in compare.compare(old, new, t) if c.regression}  # noqa: E731
    assert flagged(_result(95.0, 210.0)) == set()                       # within 10%
    assert flagged(_result(85.0, 200.0)) == {"output_throughput", "request_throughput", "total_throughput"}
    assert flagged(_result(100.0, 260.0)) == {"ttft_ms.mean", "ttft_ms.p50", "ttft_ms.p99"}
    assert flagged(_result(150.0, 100.0)) == set()                      # improvements are not regressions
    assert flagged(_result(100.0, 200.0, errors=1)) == {"errors"}
    assert flagged(_result(85.0, 200.0), t=0.2) == set()
    assert compare.compare(old, _result(50.0, 900.0, conc=8)) == []      # no step in common
    table = compare.format_changes(compare.compare(old, _result(85.0, 200.0)), only_flagged=True)
    assert "REGRESSION" in table and "-15.0%" in table
    with pytest.raises(ValueError):
        compare.compare(old, old, -1)


def test_stage_metrics_parse_and_delta():
    text = ('# HELP polychip_engine_stage_seconds_total Engine step time by stage\n'
            'polychip_engine_stage_seconds_total{model_name="m",stage="forward"} 9.0\n'
            'polychip_engine_stage_seconds_total{model_name="m",stage="schedule"} 1.0\n'
            'polychip_engine_stage_seconds_created{model_name="m",stage="forward"} 1.7e9\n'
            'polychip_engine_steps_total{model_name="m"} 100.0\n')
    before = stage_metrics.parse(text)
    assert before == {"stages": {"forward": 9.0, "schedule": 1.0}, "steps": 100.0}
    after = stage_metrics.parse(text.replace("9.0", "17.0").replace("} 1.0", "} 3.0").replace("100.0", "140.0"))
    d = stage_metrics.delta(before, after)
    assert d["seconds"] == {"forward": 8.0, "schedule": 2.0} and d["share"]["forward"] == 0.8
    assert d["steps"] == 40 and d["ms_per_step"]["forward"] == 200.0
    assert stage_metrics.delta(None, after) is None


def test_weights_only_roofline_arithmetic():
    """The roofline before issue 17 (kept for the side-by-side line): float32 weights, nothing else."""
    shape = roofline.ModelShape(hidden=8, intermediate=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=4, vocab=32, dtype_bytes=4)
    per_layer = (2 + 2) * 4 * 8 + 8 * 8 + 32 * 8 + 8 * 16
    assert shape.non_embedding_params == 2 * per_layer
    assert shape.decode_params == 2 * per_layer + 32 * 8
    m = roofline.Machine(bandwidth_gbs=1e-9 * shape.decode_weight_bytes * 10, copy_gbs=1.0,
                         matmul_gflops=1e-9 * 2 * shape.decode_params * 40, threads=1)
    # memory-bound below batch 4, compute-bound above
    assert roofline.weights_only_decode_step_seconds(shape, m, 2) == pytest.approx(0.1)
    assert roofline.weights_only_decode_step_seconds(shape, m, 8) == pytest.approx(0.2)
    w = roofline.weights_only_workload_seconds(shape, m, num_requests=16, input_len=5, output_len=3, concurrency=8)
    prefill = 16 * 5 * 2 * shape.non_embedding_params / (m.matmul_gflops * 1e9)
    assert w["prefill_s"] == pytest.approx(prefill)
    assert w["decode_s"] == pytest.approx(2 * 2 * 0.2)        # two waves of two decode steps at batch 8
    assert w["output_tok_s"] == pytest.approx(48 / (prefill + 0.8))
    assert w["single_stream_decode_tok_s"] == pytest.approx(10)
    best = roofline.best_of(m, roofline.Machine(1.0, 5.0, 1e-9, 1))
    assert best.bandwidth_gbs == 1.0 and best.copy_gbs == 5.0 and best.matmul_gflops == m.matmul_gflops


def test_honest_roofline_counts_every_byte_and_flop_by_hand():
    """A model small enough to count by hand, int8 weights and a bfloat16 KV cache."""
    shape = roofline.ModelShape(hidden=8, intermediate=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=4, vocab=32)
    # per layer: qkv 16 x 8, o 8 x 8, gate_up 32 x 8, down 8 x 16 = 576 weights and 64 output rows
    assert shape.non_embedding_params == 1152 and shape.decode_params == 1152 + 256
    int8 = roofline.Storage("int8, bf16 KV", weight_bytes=1, row_scale_bytes=4, kv_bytes=2)
    # 1408 int8 weights + (2 x 64 + 32 lm-head rows) x 4-byte scales + 5 norms x 8 x 4 bytes
    assert int8.weights(shape) == 1408 + 160 * 4 + 160 == 2208
    assert roofline.FLOAT32.weights(shape) == 1408 * 4 + 160 == 5792      # float32: no scales
    assert int8.kv_per_token(shape) == 2 * 2 * 1 * 4 * 2 == 32             # K and V, 2 layers, 1 head of 4
    assert shape.attention_flops_per_key == 4 * 2 * 2 * 4 == 64            # q.k and p.v, 2 heads, 2 layers
    assert roofline.Storage("gguf", file_weight_bytes=999).weights(shape) == 999

    # a decode step of two sequences at 10 and 30 cached tokens
    bytes_, flops = 2208 + 40 * 32 + 2 * 8 * 4, 2 * 2 * 1408 + 40 * 64
    assert (bytes_, flops) == (3552, 8192)
    mem_bound = roofline.Machine(bandwidth_gbs=3552e-9, copy_gbs=1.0, matmul_gflops=2 * 8192e-9, threads=1)
    step = roofline.decode_step(shape, int8, mem_bound, [10, 30])
    assert (step.bytes, step.flops, step.seconds) == (pytest.approx(3552), pytest.approx(8192), pytest.approx(1.0))
    compute_bound = roofline.Machine(bandwidth_gbs=4 * 3552e-9, copy_gbs=1.0, matmul_gflops=8192e-9 / 2, threads=1)
    assert roofline.decode_step(shape, int8, compute_bound, [10, 30]).seconds == pytest.approx(2.0)
    # W8A8: the same bytes, its 5632 matmul FLOPs at the int8 rate, attention's 2560 at the float one
    w8a8 = dataclasses.replace(int8, label="w8a8", int8_matmuls=True)
    with pytest.raises(ValueError, match="int8 rate was not measured"):
        roofline.decode_step(shape, w8a8, compute_bound, [10, 30])
    fast_int8 = dataclasses.replace(compute_bound, int8_gops=2 * 5632e-9)
    step = roofline.decode_step(shape, w8a8, fast_int8, [10, 30])
    assert (step.flops, step.seconds) == (8192, pytest.approx(0.5 + 2560 / (8192 / 2)))
    assert roofline.decode_step(shape, int8, fast_int8, [10, 30]).seconds == pytest.approx(2.0)   # weight-only: float

    # prefill of prompts of 3 and 5 tokens: matmuls, an LM-head row each, causal attention (6 + 15 keys)
    p = roofline.prefill(shape, int8, mem_bound, [3, 5])
    assert p.flops == 8 * 2 * 1152 + 2 * 2 * 256 + 21 * 64 == 20800
    assert p.bytes == 2208 + 8 * 8 * 4

    # 3 requests of 2 in / 3 out at concurrency 2: a wave of 2, then of 1; decode step k reads 2 + k tokens each
    one = lambda ctx: roofline.decode_step(shape, int8, mem_bound, ctx).seconds  # noqa: E731
    want_decode = one([3, 3]) + one([4, 4]) + one([3]) + one([4])
    want_prefill = (roofline.prefill(shape, int8, mem_bound, [2, 2]).seconds
                    + roofline.prefill(shape, int8, mem_bound, [2]).seconds)
    w = roofline.workload_seconds(shape, int8, mem_bound, num_requests=3, input_len=2, output_len=3, concurrency=2)
    assert w["decode_s"] == pytest.approx(want_decode) and w["prefill_s"] == pytest.approx(want_prefill)
    assert one([3, 3]) == pytest.approx((2208 + 6 * 32 + 64) / 3552)            # memory-bound: bytes / bandwidth
    assert w["output_tok_s"] == pytest.approx(9 / (want_decode + want_prefill))
    # one stream after a 10-token prompt, 2 tokens: steps at 11 and 12 cached tokens
    assert roofline.single_stream_decode_ceiling(shape, int8, mem_bound, 10, 2) == pytest.approx(
        2 / (one([11]) + one([12])))
    # a bfloat16 pool halves the KV bytes of a float32 one, nothing else
    f32kv = roofline.Storage("int8, f32 KV", weight_bytes=1, row_scale_bytes=4, kv_bytes=4)
    assert roofline.decode_step(shape, f32kv, mem_bound, [10, 30]).bytes - step.bytes == 40 * 32


def test_peers_rates_each_engine_against_its_own_roofline():
    """polychip (float32 weights, bf16 KV), its int8 row and llama.cpp (file bytes, f16 KV) each get
    their own roofline; the weights-only percentages ride along once."""
    from polychip.bench import peers
    shape = roofline.ModelShape(hidden=8, intermediate=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=4, vocab=32)
    m = roofline.Machine(bandwidth_gbs=1e-5, copy_gbs=1.0, matmul_gflops=1e-3, threads=1)
    cfg = peers.PeersConfig(input_len=10, output_len=4, concurrency=2, decode_tokens=3, kv_cache_dtype="bfloat16")
    storages = {"polychip": peers.storage_of("polychip", cfg, None),
                "polychip-int8": peers.storage_of("polychip-int8", cfg, None),
                "llama.cpp": roofline.Storage("gguf", kv_bytes=2, file_weight_bytes=1000)}
    assert storages["polychip"].kv_bytes == 2 and storages["polychip-int8"].weight_bytes == 1
    row = lambda name: {"engine": name, "output_tok_s": 50.0, "decode_tok_s": 20.0, "prefill_tok_s": 100.0,  # noqa: E731
                        "wall_s": 1.0, "mean_ttft_s": 0.1}
    engines = {k: row(k) for k in storages}
    engines["polychip"]["single_stream_read_gbs"] = 0.5e-5     # its single stream fell in a slower moment
    res = peers._analyse(cfg, 2, shape, m, [m], engines, {}, storages)
    slow = roofline.Machine(bandwidth_gbs=0.5e-5, copy_gbs=1.0, matmul_gflops=1e-3, threads=1)
    at_its_read = 100 * 20 / roofline.single_stream_decode_ceiling(shape, storages["polychip"], slow, 10, 3)
    assert engines["polychip"]["pct_decode_roofline_at_its_read"] == pytest.approx(at_its_read)
    assert at_its_read > engines["polychip"]["pct_decode_roofline"]    # a slower read, a lower ceiling
    assert "pct_decode_roofline_at_its_read" not in engines["llama.cpp"]
    for name, st in storages.items():
        roof = roofline.workload_seconds(shape, st, m, 2, 10, 4, 2)
        assert engines[name]["pct_workload_roofline"] == pytest.approx(100 * 50 / roof["output_tok_s"])
        ceiling = roofline.single_stream_decode_ceiling(shape, st, m, 10, 3)
        assert engines[name]["pct_decode_roofline"] == pytest.approx(100 * 20 / ceiling)
    old = roofline.weights_only_workload_seconds(shape, m, 2, 10, 4, 2)
    assert engines["polychip"]["pct_weights_only_workload_roofline"] == pytest.approx(100 * 50 / old["output_tok_s"])
    # fewer bytes per step, a faster roofline: int8 < float32 in %; llama.cpp's 1000 file bytes fewer still
    pct = {k: engines[k]["pct_workload_roofline"] for k in engines}
    assert pct["polychip-int8"] < pct["polychip"] and pct["llama.cpp"] < pct["polychip-int8"]
    table = peers.peers_table(res | {"device": "cpu"})
    assert "polychip (float32 weights, bfloat16 KV)" in table and "before issue 17" in table
    assert f"polychip 20.0 tok/s at 0.0 GB/s, {at_its_read:.0f}%" in table


def test_serving_roofline_reads_the_servers_storage():
    from polychip.bench.serving_roofline import storage_of_server
    st = storage_of_server({"dtype": "bfloat16", "kv_cache_dtype": "float8_e4m3fn", "quantization": "int8"})
    assert (st.weight_bytes, st.row_scale_bytes, st.kv_bytes, st.float_bytes) == (1, 2, 1, 2)
    st = storage_of_server({"dtype": "float32"})                   # a server from before kv_cache_dtype
    assert (st.weight_bytes, st.row_scale_bytes, st.kv_bytes) == (4, 0, 4)
    st = storage_of_server({"dtype": "float32", "kv_cache_dtype": "bfloat16", "quantization": "w8a8"})
    assert (st.weight_bytes, st.row_scale_bytes, st.kv_bytes, st.int8_matmuls) == (1, 4, 2, True)
    with pytest.raises(ValueError, match="w4a16"):               # group scales: no roofline, not a float one
        storage_of_server({"dtype": "float32", "quantization": "w4a16"})


def test_peers_and_serving_rate_polychip_by_the_same_storage():
    from polychip.bench import peers
    from polychip.bench.serving_roofline import storage_of_server
    cfg = peers.PeersConfig(input_len=10, output_len=4, concurrency=2, decode_tokens=3, kv_cache_dtype="bfloat16")
    for name, quantization in (("polychip", None), ("polychip-int8", "int8"), ("polychip-w8a8", "w8a8")):
        served = storage_of_server({"dtype": "float32", "kv_cache_dtype": "bfloat16", "quantization": quantization})
        assert peers.storage_of(name, cfg, None) == served


def test_serving_roofline_names_why_a_w4a16_server_has_none(monkeypatch, tmp_path):
    from polychip.bench import serving_roofline

    class Reply:
        def raise_for_status(self):
            pass

        def json(self):
            return {"model_path": str(tmp_path), "dtype": "float32", "quantization": "w4a16"}

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(serving_roofline.httpx, "get", lambda *a, **k: Reply())
    monkeypatch.setattr("polychip.models.loader.read_config", lambda folder: None)
    monkeypatch.setattr(serving_roofline.rl.ModelShape, "from_config", staticmethod(lambda cfg: "shape"))
    roof, why = serving_roofline.prepare("http://127.0.0.1:1")
    assert roof is None and "w4a16" in why and "not modelled" in why


def test_gguf_weight_bytes_are_the_files_tensors():
    from polychip.bench import peers
    from polychip.models import gguf
    path = gguf.default_gguf_path()
    nbytes = peers.gguf_weight_bytes(path)
    import os
    assert 0.9 * os.path.getsize(path) < nbytes < os.path.getsize(path)     # the tensors, less the header


def test_peers_shared_prefix_check_runs_a_cold_then_a_warm_wave():
    """Two waves share one prefix with new suffixes; speedups are against the distinct run."""
    import random
    from polychip.bench import peer_targets, peers
    from polychip.bench.peer_engines import WorkloadRun

    class FakeEngine:
        def __init__(self):
            self.waves, self.ttfts = [], iter([2.0, 1.0])

        def workload(self, prompts, output_len, concurrency):
            self.waves.append(prompts)
            return WorkloadRun("fake", 1.0, 0, 4, [next(self.ttfts)] * len(prompts))

    eng = FakeEngine()
    cfg = peers.PeersConfig(input_len=12, shared_prefix_len=8, output_len=1, concurrency=3)
    distinct = WorkloadRun("fake", 1.0, 0, 3, [10.0, 10.0, 10.0])
    res = peers._shared_prefix_check(eng, cfg, 1000, random.Random(0), distinct)
    cold, warm = eng.waves
    assert all(p[:8] == cold[0][:8] for p in cold + warm) and len({tuple(p[8:]) for p in cold + warm}) == 6
    assert res["ttft_speedup"] == 5.0 and res["warm_ttft_speedup"] == 10.0
    report = peer_targets.targets_report({"config": {"output_len": 1}, "ratios": {},
                                   "engines": {"polychip": {"pct_workload_roofline": 50.0, "pct_decode_roofline": 10.0,
                                                            "shared_prefix": res}}})
    assert "cold: first wave: mean TTFT >= 4x lower | 5.00x (10.00 s -> 2.00 s) | yes" in report
    assert "warm: prefix cached by an earlier wave: mean TTFT lower | 10.00x" in report
    assert "| % of workload roofline (auto KV) | 50.0% | - |" in report     # the 80% target is for 512 output tokens
    assert "single-stream decode, float32 weights, >= 70% of its roofline | 10.0% | NO" in report


def test_peers_targets_at_800_in_512_out_are_issue_38s():
    """Our users' workload (512 output tokens) is held to issue 38's targets: 80% of the roofline, 3x
    transformers' static batch, int8 single-stream at 60% of its roofline, a cold shared-prefix wave 5x."""
    from polychip.bench import peer_targets
    shared = {"prefix_len": 700, "ttft_speedup": 4.5, "distinct_mean_ttft_s": 9.0, "mean_ttft_s": 2.0,
              "warm_ttft_speedup": 6.0, "warm_mean_ttft_s": 1.5}
    engines = {"polychip": {"pct_workload_roofline": 81.0, "pct_decode_roofline": 71.0, "shared_prefix": shared,
                            "decode_tok_s": 90.0},
               "polychip-int8": {"pct_decode_roofline": 59.0, "decode_tok_s": 260.0},
               "hf-static": {"engine": "transformers static batch"}}
    report = peer_targets.targets_report({"config": {"output_len": 512, "kv_cache_dtype": "bfloat16"},
                                          "ratios": {"hf-static": 2.9}, "engines": engines})
    assert ">= 3.0x transformers static batch | 2.90x | NO" in report
    assert "| % of workload roofline (bfloat16 KV) >= 80% | 81.0% | yes |" in report
    assert "int8 weights, bfloat16 KV, >= 60% of its roofline | 59.0% | NO" in report
    assert "cold: first wave: mean TTFT >= 5x lower | 4.50x (9.00 s -> 2.00 s) | NO" in report
