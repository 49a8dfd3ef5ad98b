"""The one workload the three benchmark clients of ``third_party_clients.py`` get, and the CPU each
side spends on it.

The prompts are made once (``polychip.bench.datasets.synthetic``: random token ids re-encoded to an
exact length) and written in each client's own file format, so all three send the same texts, in
the same order, and ask for the same number of output tokens:

- ``polychip bench serving --dataset sharegpt-like``: ``{"prompt", "completion": ""}`` (an empty
  completion means "the requested output length");
- AIPerf ``--custom-dataset-type single_turn``: ``{"text", "output_length"}``;
- GuideLLM ``--data FILE``: ``{"prompt", "output_tokens_count"}`` (its column mapper's names).

On a 2-core machine the client competes with the server for CPU: ``cpu_seconds`` reads what a
process tree has used so far (utime + stime from /proc), so the script can report the client's and
the server's share of each run.
"""
from __future__ import annotations

import json
import os
import time

import httpx

FORMATS = {
    "ours": lambda text, out: {"prompt": text, "completion": ""},
    "aiperf": lambda text, out: {"text": text, "output_length": out},
    "guidellm": lambda text, out: {"prompt": text, "output_tokens_count": out},
}


def write_datasets(prompts: list[str], output_len: int, folder: str) -> dict[str, str]:
    """One JSONL file per client format holding ``prompts`` in order; {format: path}."""
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for name, record in FORMATS.items():
        path = os.path.join(folder, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for text in prompts:
                f.write(json.dumps(record(text, output_len)) + "\n")
        paths[name] = path
    return paths


def exact_prompts(tokenizer, n: int, input_len: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of exactly ``input_len`` tokens by ``tokenizer``; raises if one is not."""
    from polychip.bench.datasets import synthetic
    reqs = synthetic(tokenizer, n, input_len, 1, seed)
    wrong = [r.prompt_len for r in reqs if r.prompt_len != input_len]
    if wrong or len({r.prompt for r in reqs}) != n:
        raise ValueError(f"prompts of {wrong} tokens (wanted {input_len}) or repeated prompts")
    return [r.prompt for r in reqs]


def measured_and_warm_prompts(tokenizer, n: int, input_len: int) -> tuple[list[str], str]:
    """``n`` prompts the clients send, and one more of the same length for the warm-up request before each
    client run: never one of theirs, so it leaves nothing in the prefix cache they could hit."""
    prompts = exact_prompts(tokenizer, n + 1, input_len)
    return prompts[:n], prompts[n]


def timed_request(url: str, model: str, prompt: str, output_len: int, greedy: bool = True) -> dict:
    """One streamed completion timed here, with no benchmark client in the way: TTFT (send to the first text
    chunk) and TPOT ((last text chunk - first) / (tokens - 1)); tokens from the server's usage, else (a stream
    without usage, as llama-cpp-python's) the text chunks counted."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if greedy:
        body["temperature"] = 0.0
    start = time.perf_counter()
    first = last = None
    usage = chunks = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            line = line.strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or []):
                last = time.perf_counter()
                first, chunks = first or last, chunks + 1
    tokens = usage or chunks
    if first is None or tokens < 2:
        raise RuntimeError(f"{url}: a streamed completion of {tokens} tokens; asked for {output_len}")
    return {"ttft_ms": round((first - start) * 1e3, 1), "tpot_ms": round((last - first) * 1e3 / (tokens - 1), 2),
            "wall_s": last - start, "tokens": tokens}


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime in clock ticks) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()     # the name may hold spaces and ')'
    except OSError:
        return None
    return int(fields[1]), float(fields[11]) + float(fields[12])


def cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live descendants (threads included)."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (s := _stat(int(name))) is not None:
            stats[int(name)] = s
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in stats and p not in tree:
            tree.add(p)
            todo += [c for c, (parent, _) in stats.items() if parent == p]
    return sum(stats[p][1] for p in tree) / os.sysconf("SC_CLK_TCK")


def _proc_stat_seconds(cpus: set[int] | None, columns: tuple[int, ...]) -> float:
    """The seconds /proc/stat counts in ``columns`` (0 user, 1 nice, 2 system, ... 7 steal) on ``cpus``."""
    total = 0.0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu" and (cpus is None or int(name[3:]) in cpus):
                total += sum(float(fields[i]) for i in columns)
    return total / os.sysconf("SC_CLK_TCK")


def steal_seconds(cpus: set[int] | None) -> float:
    """Seconds the hypervisor has taken from ``cpus`` (all when None) so far."""
    return _proc_stat_seconds(cpus, (7,))


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used so far (user, nice, system, irq, softirq)."""
    return _proc_stat_seconds(None, (0, 1, 2, 5, 6))


class CpuSampler:
    """Samples the CPU seconds of a server's and a client's process trees every ``interval`` s (a thread),
    to tell what the client used while the server was working: its start-up and report writing, when
    the server is idle, steal nothing from the figures. The machine's total tells what everything else used
    meanwhile: on 2 cores other work on the client's core still slows the server (shared cache and memory)."""

    def __init__(self, server_pid: int, interval: float = 0.5):
        import threading
        self.server_pid, self.client_pid, self.interval = server_pid, None, interval
        self.samples: list[tuple[float, float, float, float]] = []    # (time, server, client, machine cpu s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import time
        while not self._stop.is_set():
            client = cpu_seconds(self.client_pid) if self.client_pid else 0.0
            self.samples.append((time.monotonic(), cpu_seconds(self.server_pid), client, machine_busy_seconds()))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def busy_share(samples: list[tuple[float, float, float, float]], busy_cores: float = 0.5) -> dict:
    """Over the sampling intervals in which the server used more than ``busy_cores`` cores: their
    length, and the mean cores the server, the client and everything else (this script included) used."""
    busy_s = server = client = other = 0.0
    for (t0, s0, c0, m0), (t1, s1, c1, m1) in zip(samples, samples[1:]):
        dt = t1 - t0
        if dt > 0 and (s1 - s0) / dt > busy_cores:
            busy_s, server, client = busy_s + dt, server + s1 - s0, client + max(c1 - c0, 0.0)
            other += max((m1 - m0) - (s1 - s0) - max(c1 - c0, 0.0), 0.0)
    if busy_s == 0:
        return {"busy_s": 0.0, "server_cores": None, "client_cores": None, "other_cores": None}
    return {"busy_s": round(busy_s, 1), "server_cores": round(server / busy_s, 2),
            "client_cores": round(client / busy_s, 2), "other_cores": round(other / busy_s, 2)}
