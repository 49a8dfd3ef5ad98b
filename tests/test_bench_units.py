"""Bench units: statistics, datasets, compare thresholds, metric parsing, roofline arithmetic."""
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


def test_roofline_arithmetic():
    shape = roofline.ModelShape(hidden=8, intermediate=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=4, vocab=32, dtype_bytes=4)
    per_layer = (2 + 2) * 4 * 8 + 8 * 8 + 32 * 8 + 8 * 16
    assert shape.non_embedding_params == 2 * per_layer
    assert shape.decode_params == 2 * per_layer + 32 * 8
    m = roofline.Machine(bandwidth_gbs=1e-9 * shape.decode_weight_bytes * 10, copy_gbs=1.0,
                         matmul_gflops=1e-9 * 2 * shape.decode_params * 40, threads=1)
    # memory-bound below batch 4, compute-bound above
    assert roofline.single_stream_decode_ceiling(shape, m) == pytest.approx(10)
    assert roofline.decode_step_seconds(shape, m, 2) == pytest.approx(0.1)
    assert roofline.decode_step_seconds(shape, m, 8) == pytest.approx(0.2)
    w = roofline.workload_seconds(shape, m, num_requests=16, input_len=5, output_len=3, concurrency=8)
    prefill = 16 * 5 * 2 * shape.non_embedding_params / (m.matmul_gflops * 1e9)
    assert w["prefill_s"] == pytest.approx(prefill)
    assert w["decode_s"] == pytest.approx(2 * 2 * 0.2)        # two waves of two decode steps at batch 8
    assert w["output_tok_s"] == pytest.approx(48 / (prefill + 0.8))
    best = roofline.best_of(m, roofline.Machine(1.0, 5.0, 1e-9, 1))
    assert best.bandwidth_gbs == 1.0 and best.copy_gbs == 5.0 and best.matmul_gflops == m.matmul_gflops


def test_peers_shared_prefix_check_runs_a_cold_then_a_warm_wave():
    """Two waves share one prefix with new suffixes; speedups are against the distinct run."""
    import random
    from polychip.bench import peers
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
    report = peers.targets_report({"config": {"output_len": 1}, "ratios": {},
                                   "engines": {"polychip": {"pct_workload_roofline": 50.0, "pct_decode_roofline": 10.0,
                                                            "shared_prefix": res}}})
    assert "cold: first wave: mean TTFT >= 5x lower | 5.00x (10.00 s -> 2.00 s) | yes" in report
    assert "warm: prefix cached by an earlier wave: mean TTFT >= 5x lower | 10.00x" in report
    assert "| % of workload roofline | 50.0% | - |" in report     # the 75% target is for 512 output tokens
