"""benchmarks/client_workload.py and the pure parts of benchmarks/third_party_clients.py: the three
benchmark clients get one workload (the same prompts, in order, and the same output length, each in
its own file format), and the CPU a process tree spends is counted with its descendants."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from polychip.bench import datasets

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import client_rounds as rounds  # noqa: E402  (benchmarks/ is not a package)
import client_workload as workload  # noqa: E402
import third_party_clients as clients  # noqa: E402

pytestmark = pytest.mark.device_independent     # no model runs


class WordTokenizer:
    """One token a word; ids index a fixed vocabulary of words."""
    vocab = [f"w{i}" for i in range(500)]
    vocab_size = len(vocab)

    def encode(self, text, add_special_tokens=False):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids):
        return " ".join(self.vocab[i] for i in ids)


def test_each_client_file_holds_the_same_prompts_in_order_with_the_output_length(tmp_path):
    prompts = workload.exact_prompts(WordTokenizer(), 5, 12, seed=3)
    paths = workload.write_datasets(prompts, 34, str(tmp_path))
    rows = {name: [json.loads(line) for line in open(path)] for name, path in paths.items()}
    assert [r["prompt"] for r in rows["ours"]] == prompts
    assert [r["text"] for r in rows["aiperf"]] == prompts                  # AIPerf single_turn
    assert [r["prompt"] for r in rows["guidellm"]] == prompts              # GuideLLM's text column
    assert [r["output_length"] for r in rows["aiperf"]] == [34] * 5
    assert [r["output_tokens_count"] for r in rows["guidellm"]] == [34] * 5
    # our client reads its file as a sharegpt-like dataset: every prompt, at the asked output length
    ours = datasets.sharegpt_like(WordTokenizer(), paths["ours"], 5, 12, 34)
    assert sorted(r.prompt for r in ours) == sorted(prompts)
    assert {(r.prompt_len, r.output_len) for r in ours} == {(12, 34)}


def test_exact_prompts_are_distinct_and_exact_or_refused():
    prompts = workload.exact_prompts(WordTokenizer(), 6, 20)
    assert len(set(prompts)) == 6 and {len(p.split()) for p in prompts} == {20}

    class Longer(WordTokenizer):        # every text encodes one token longer than asked: never exact
        def encode(self, text, add_special_tokens=False):
            return super().encode(text) + [1]
    with pytest.raises(ValueError, match="wanted 20"):
        workload.exact_prompts(Longer(), 2, 20)


def test_cpu_seconds_counts_the_descendants_of_a_process(tmp_path):
    done = tmp_path / "done"
    burn = (f"import time, pathlib\nwhile time.process_time() < 0.4: pass\n"
            f"pathlib.Path({str(done)!r}).write_text('x')\ntime.sleep(30)")
    # a shell that uses no CPU itself, whose child (a grandchild of the test) burns 0.4 s of it
    shell = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"$BURN\"; true"], env={**os.environ, "BURN": burn})
    try:
        deadline = time.time() + 60
        while not done.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert done.exists()
        assert workload.cpu_seconds(shell.pid) >= 0.35
    finally:
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            stat = workload._stat(pid)
            if stat and stat[0] == shell.pid:
                os.kill(pid, 9)
        shell.kill()
        shell.wait()


def test_busy_share_takes_only_the_intervals_in_which_the_server_works():
    # (time, server, client, whole machine cpu s): idle 0-1 s (client starting up: 1 core), busy 1-3 s,
    # in which something else used 0.5 then 0.1 of a core
    samples = [(0.0, 0.0, 0.0, 0.0), (1.0, 0.1, 1.0, 1.1), (2.0, 1.0, 1.3, 2.8), (3.0, 1.8, 1.5, 3.9)]
    got = workload.busy_share(samples)
    assert got == {"busy_s": 2.0, "server_cores": 0.85, "client_cores": 0.25, "other_cores": 0.3}
    assert workload.busy_share(samples[:2])["busy_s"] == 0.0


def test_a_pinned_server_gets_as_many_threads_as_cores():
    polychip = clients.server_command("polychip", 1, "m.gguf", "--quantization int8", 1)
    assert polychip[polychip.index("--num-threads") + 1] == "1"
    assert clients.server_command("polychip", 1, "m.gguf", "--num-threads 3", 1).count("--num-threads") == 1
    llama = clients.server_command("llama.cpp", 1, "m.gguf", "", 1)
    assert llama[llama.index("--n_threads") + 1] == "1"


def test_the_third_party_reports_are_read_as_documented():
    aiperf = {"output_token_throughput": {"avg": 100.0}, "time_to_first_token": {"avg": 50.0},
              "inter_token_latency": {"avg": 9.0}, "request_count": {"avg": 4}, "total_output_tokens": {"avg": 2048},
              "total_isl": {"avg": 3200}, "benchmark_duration": {"unit": "sec", "avg": 20.48}}
    assert clients.aiperf_figures(aiperf) == {"output_tok_s": 100.0, "ttft_ms": 50.0, "itl_ms": 9.0, "completed": 4,
                                              "output_tokens": 2048, "input_tokens": 3200, "duration_s": 20.48}
    ok = lambda mean, total=None: {"successful": {"mean": mean, "total_sum": total}}  # noqa: E731
    guidellm = {"benchmarks": [{"duration": 21.0, "metrics": {
        "output_tokens_per_second": ok(97.5), "time_to_first_token_ms": ok(55.0), "inter_token_latency_ms": ok(9.5),
        "request_totals": {"successful": 4}, "output_token_count": ok(512, 2048), "prompt_token_count": ok(800, 3200)}}]}
    assert clients.guidellm_figures(guidellm) == {"output_tok_s": 97.5, "ttft_ms": 55.0, "itl_ms": 9.5, "completed": 4,
                                                  "output_tokens": 2048, "input_tokens": 3200, "duration_s": 21.0}


def test_our_itl_is_the_per_request_tpot_as_the_third_parties_define_it():
    step = {"output_throughput": 120.0, "ttft_ms": {"mean": 900.0}, "tpot_ms": {"mean": 6.5}, "itl_ms": {"mean": 6.4},
            "completed": 2, "output_tokens": 1024, "input_tokens": 1600, "duration_s": 8.5}
    assert clients.ours_figures(step) == {"output_tok_s": 120.0, "ttft_ms": 900.0, "itl_ms": 6.5, "pooled_itl_ms": 6.4,
                                          "completed": 2, "output_tokens": 1024, "input_tokens": 1600, "duration_s": 8.5}


def test_aiperf_counts_the_servers_usage_only_where_the_server_sends_one():
    from types import SimpleNamespace
    load = SimpleNamespace(input_len=8, output_len=4)
    cmd = lambda usage: clients.aiperf_command("http://h:1", "tok", 1, 2, SimpleNamespace(**vars(load), server_usage=usage),  # noqa: E731
                                               {"aiperf": "d.jsonl"}, "out")
    assert "--use-server-token-count" in cmd(True)          # polychip: usage.completion_tokens, as the others
    assert "--use-server-token-count" not in cmd(False)     # llama-cpp-python: none, AIPerf re-tokenises
    body = [cmd(True)[i + 1] for i, arg in enumerate(cmd(True)) if arg == "--extra-inputs"]
    assert body == ["temperature:0.0", "ignore_eos:true", "min_tokens:4"]


def test_clients_run_in_a_balanced_order_so_a_steady_drift_lands_on_each_alike():
    assert rounds.balanced_order(["A", "B", "C"], 2) == ["A", "B", "C", "C", "B", "A"]
    assert rounds.balanced_order(["A", "B"], 3) == ["A", "B", "B", "A", "A", "B"]
    with pytest.raises(ValueError):
        rounds.balanced_order(["A"], 0)
    # the server slows by 1 tok/s every run: in A B C C B A every client's mean is the same
    order = rounds.balanced_order(["A", "B", "C"], 2)
    rows = [{"concurrency": 1, "client": name, "output_tok_s": 100.0 - i, "ttft_ms": 10.0, "itl_ms": 5.0}
            for i, name in enumerate(order)]
    summary = rounds.summarise(rows)[0]
    assert {m["output_tok_s"] for m in summary["clients"].values()} == {97.5}
    assert summary["spread_output_tok_s"] == 0.0
    assert summary["clients"]["A"]["own_spread"] == pytest.approx(100 / 95 - 1)


def test_the_summary_is_each_clients_mean_of_its_own_runs_and_the_spread_of_those_means():
    row = lambda c, name, tok_s, ttft, itl: {"concurrency": c, "client": name, "output_tok_s": tok_s,  # noqa: E731
                                             "ttft_ms": ttft, "itl_ms": itl}
    rows = [row(1, "ours", 100.0, 1000.0, 7.0), row(1, "aiperf", 110.0, 900.0, None),
            row(1, "aiperf", 130.0, 1100.0, None), row(1, "ours", 120.0, 1200.0, 9.0),
            row(4, "ours", 200.0, 3000.0, 15.0)]
    by_c = {s["concurrency"]: s for s in rounds.summarise(rows)}
    assert by_c[1]["clients"]["ours"] == {"output_tok_s": 110.0, "ttft_ms": 1100.0, "itl_ms": 8.0, "runs": 2,
                                          "own_spread": pytest.approx(0.2)}
    assert by_c[1]["clients"]["aiperf"]["output_tok_s"] == 120.0
    assert by_c[1]["clients"]["aiperf"]["itl_ms"] is None           # a figure it never reported stays out
    assert by_c[1]["spread_output_tok_s"] == pytest.approx(120 / 110 - 1)
    assert by_c[1]["spread_ttft_ms"] == pytest.approx(0.1) and by_c[1]["spread_itl_ms"] is None
    assert by_c[4]["spread_output_tok_s"] is None and by_c[4]["clients"]["ours"]["runs"] == 1
    table = rounds.report(list(by_c.values()))
    assert "| 1 | aiperf | 2 | 120.0 | 18.2% | 1000 | - |" in table and "out tok/s 9.1%" in table


def test_the_warm_up_prompt_has_the_measured_length_and_is_never_measured():
    prompts, warm = workload.measured_and_warm_prompts(WordTokenizer(), 4, 16)
    assert len(prompts) == 4 and warm not in prompts
    assert {len(p.split()) for p in [*prompts, warm]} == {16}
    # the shared prefix with every measured prompt is short: the warm-up leaves nothing they could reuse
    assert all(os.path.commonprefix([warm.split(), p.split()]) == [] for p in prompts)


def test_steal_and_busy_seconds_are_read_per_core_from_proc_stat(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4 5 6 7 300 0 0\ncpu0 1 2 3 4 5 6 7 100 0 0\ncpu1 1 2 3 4 5 6 7 200 0 0\nintr 1\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path, *a, **k))
    tick = os.sysconf("SC_CLK_TCK")
    assert workload.steal_seconds({0}) == 100 / tick
    assert workload.steal_seconds({1}) == 200 / tick
    assert workload.steal_seconds(None) == 300 / tick
    assert workload.machine_busy_seconds() == 2 * (1 + 2 + 3 + 6 + 7) / tick    # user nice system irq softirq


def test_runs_are_paired_by_pass_so_a_late_step_in_the_servers_speed_cancels():
    # three clients, four passes A B C / C B A / A B C / C B A; the server is 20% slower from run 6 on, and
    # the probe (the server alone) sees it; aiperf reads 2% above its pass's mean and guidellm 2% below, always
    order = rounds.balanced_order(["ours", "aiperf", "guidellm"], 4)
    bias = {"ours": 1.0, "aiperf": 1.02, "guidellm": 0.98}
    rows = [{"concurrency": 1, "run": i, "client": name, "output_tok_s": (100.0 if i < 6 else 80.0) * bias[name],
             "ttft_ms": 1000.0, "itl_ms": None, "probe_tpot_ms": 7.0 if i < 6 else 8.4, "probe_ttft_ms": 900.0,
             "server_cpu_ms_per_token": 9.0} for i, name in enumerate(order)]
    assert [[r["client"] for r in p] for p in rounds.passes(rows)][:2] == [["ours", "aiperf", "guidellm"],
                                                                           ["guidellm", "aiperf", "ours"]]
    got = rounds.paired(rows)[0]
    assert got["passes"] == 4
    assert got["output_tok_s"]["ratio"] == pytest.approx(bias)             # the step cancels within each pass
    assert got["output_tok_s"]["spread"] == pytest.approx(1.02 / 0.98 - 1)
    assert got["output_tok_s"]["median_pass_spread"] == pytest.approx(1.02 / 0.98 - 1)
    assert got["ttft_ms"]["spread"] == 0.0 and got["itl_ms"]["spread"] is None    # a figure no client reported
    assert got["drift_probe_tpot_ms"] == pytest.approx(0.2) and got["drift_server_cpu_ms_per_token"] == 0.0
    # an incomplete last pass is no pass
    assert len(rounds.passes(rows[:-1])) == 3
    assert rounds.passes(rows[:2], clients=3) == [] and rounds.paired(rows[:2], clients=3)[0]["passes"] == 0
    text = rounds.paired_report([got]) + rounds.runs_table(rows)
    assert "probe TPOT 20.0%" in text and "| 1 | 11 | ours | 80.0 | 1000 | - | 900 | 8.40 | 9.00 |" in text
