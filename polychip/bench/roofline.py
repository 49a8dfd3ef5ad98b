"""Machine ceilings measured in the run that uses them, and the workload roofline built on them.

* memory bandwidth: the best of a few full reads (sum) of a tensor far larger than the caches;
* matmul FLOP/s: the best of a few passes over one decoder layer's matmuls at the model's shapes;
* the workload roofline: prompt tokens x 2 x (non-embedding params) / FLOP/s, plus, for each
  decode step, the larger of weight bytes / bandwidth and batch x 2 x params / FLOP/s.

Both are measured on a device plugin's device (the CPU when none is given); the plugin's
``synchronize`` runs before every clock read, since accelerator work is asynchronous.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 4

    @classmethod
    def from_config(cls, cfg, dtype_bytes: int = 4) -> "ModelShape":
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.vocab_size, dtype_bytes)

    def layer_matmuls(self) -> list[tuple[int, int]]:
        """(out, in) of each matmul in one decoder layer (qkv and gate/up merged)."""
        d = self.head_dim
        return [((self.num_heads + 2 * self.num_kv_heads) * d, self.hidden), (self.hidden, self.num_heads * d),
                (2 * self.intermediate, self.hidden), (self.hidden, self.intermediate)]

    @property
    def non_embedding_params(self) -> int:
        return self.num_layers * sum(o * i for o, i in self.layer_matmuls())

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def decode_params(self) -> int:
        """Parameters multiplied per decoded token: the layers and the LM head."""
        return self.non_embedding_params + self.lm_head_params

    @property
    def decode_weight_bytes(self) -> int:
        return self.decode_params * self.dtype_bytes


@dataclass
class Machine:
    bandwidth_gbs: float      # read bandwidth
    copy_gbs: float           # copy (read + write) bandwidth
    matmul_gflops: float      # at the model's shapes
    threads: int
    device: str = "cpu"       # the torch device the ceilings were measured on

    def as_dict(self) -> dict:
        return asdict(self)


def _target(plugin) -> tuple[torch.device, Callable[[], None]]:
    """(torch device, synchronise) of ``plugin``; the CPU, with nothing to wait for, when None."""
    if plugin is None:
        return torch.device("cpu"), lambda: None
    return plugin.device_handle(), plugin.synchronize


def _best(fn, reps: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(mib: int = 512, reps: int = 5, dtype=torch.float32, plugin=None) -> tuple[float, float]:
    """(read GB/s, copy GB/s) on ``plugin``'s device, best of ``reps``."""
    device, sync = _target(plugin)
    x = torch.ones(mib * 2**20 // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    read = nbytes / _best(lambda: x.sum(), reps, sync) / 1e9
    copy = 2 * nbytes / _best(lambda: y.copy_(x), reps, sync) / 1e9
    return read, copy


def measure_matmul(shape: ModelShape, tokens: int = 512, reps: int = 5, dtype=torch.float32, plugin=None) -> float:
    """GFLOP/s of one layer's matmuls on ``tokens`` rows on ``plugin``'s device, best of ``reps``."""
    device, sync = _target(plugin)
    ws = [torch.randn(o, i, dtype=dtype, device=device) * 0.02 for o, i in shape.layer_matmuls()]
    xs = {i: torch.randn(tokens, i, dtype=dtype, device=device) for _, i in shape.layer_matmuls()}
    flops = sum(2 * tokens * o * i for o, i in shape.layer_matmuls())

    def layer():
        for w in ws:
            F.linear(xs[w.shape[1]], w)

    with torch.inference_mode():
        return flops / _best(layer, reps, sync) / 1e9


def measure_machine(shape: ModelShape, reps: int = 5, plugin=None, mib: int = 512) -> Machine:
    """The ceilings of ``plugin``'s device (the CPU when None)."""
    read, copy = measure_bandwidth(mib, reps, plugin=plugin)
    return Machine(read, copy, measure_matmul(shape, reps=reps, plugin=plugin), torch.get_num_threads(),
                   str(_target(plugin)[0]))


def best_of(a: Machine, b: Machine) -> Machine:
    """The machine's ceiling from two measurements in one run (noise only ever slows it down)."""
    return Machine(max(a.bandwidth_gbs, b.bandwidth_gbs), max(a.copy_gbs, b.copy_gbs),
                   max(a.matmul_gflops, b.matmul_gflops), a.threads, a.device)


def decode_step_seconds(shape: ModelShape, m: Machine, batch: int) -> float:
    memory = shape.decode_weight_bytes / (m.bandwidth_gbs * 1e9)
    compute = batch * 2 * shape.decode_params / (m.matmul_gflops * 1e9)
    return max(memory, compute)


def single_stream_decode_ceiling(shape: ModelShape, m: Machine) -> float:
    """Tokens/s of one stream if every decode step only read the weights once at full bandwidth."""
    return 1.0 / decode_step_seconds(shape, m, 1)


def prefill_ceiling(shape: ModelShape, m: Machine) -> float:
    """Prompt tokens/s if prefill ran at the measured matmul speed."""
    return m.matmul_gflops * 1e9 / (2 * shape.non_embedding_params)


def workload_seconds(shape: ModelShape, m: Machine, num_requests: int, input_len: int, output_len: int,
                     concurrency: int) -> dict:
    """Roofline time of ``num_requests`` requests run in waves of ``concurrency``: prefill at matmul
    speed, then ``output_len - 1`` decode steps per wave (prefill gives the first token)."""
    prefill = num_requests * input_len * 2 * shape.non_embedding_params / (m.matmul_gflops * 1e9)
    decode, left = 0.0, num_requests
    while left > 0:
        b = min(concurrency, left)
        decode += max(output_len - 1, 0) * decode_step_seconds(shape, m, b)
        left -= b
    total = prefill + decode
    return {"prefill_s": prefill, "decode_s": decode, "total_s": total,
            "output_tok_s": num_requests * output_len / total if total else 0.0}
