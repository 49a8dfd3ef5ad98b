"""Machine ceilings measured in the run that uses them, and the workload roofline built on them.

* memory bandwidth: the best of a few full reads (sum) of a tensor far larger than the caches;
* matmul FLOP/s: the best of a few passes over one decoder layer's matmuls at the model's shapes;
  where a W8A8 engine runs, the same for its int8 matmuls (``linear_w8a8``: int8 ops/s);
* the workload roofline: every step takes the larger of its bytes / bandwidth and its FLOPs /
  FLOP/s. A step's bytes are everything it must read: the weights as the engine stores them
  (``Storage``: float32 4 bytes, int8 1 byte plus its per-row scales, a GGUF file's own tensor
  bytes), the embedding rows of its tokens, and the KV cache of every sequence in the batch at
  its current length in the KV dtype. Its FLOPs are the matmuls' (2 per weight per token, the LM
  head only for the rows that sample; at the int8 rate for a W8A8 storage) plus attention's (4 x
  heads x head_dim per query token per key it attends to, causal in prefill, always float).

``weights_only_*`` is the roofline before issue 17 (float32 weights, no KV bytes, no attention
FLOPs), kept to show the change once beside the honest one.

Both are measured on a device plugin's device (the CPU when none is given); the plugin's
``synchronize`` runs before every clock read, since accelerator work is asynchronous.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from polychip.devices import memory


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
        """float32 weights of the layers and the LM head: the weights-only roofline's bytes."""
        return self.decode_params * self.dtype_bytes

    @property
    def attention_flops_per_key(self) -> int:
        """FLOPs of one query token against one cached token, all layers: q.k and p.v for every head."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


@dataclass(frozen=True)
class Storage:
    """How an engine stores what a step reads: bytes per matmul weight (4 float32, 1 int8) plus bytes
    of scale per output row (int8's per-channel scales), or the measured bytes of all its weights
    (a GGUF file); bytes per cached K or V element (the KV dtype); bytes per embedding and norm value."""

    label: str
    weight_bytes: float = 4
    row_scale_bytes: int = 0
    kv_bytes: float = 4
    float_bytes: int = 4
    file_weight_bytes: int | None = None
    int8_matmuls: bool = False      # W8A8: the matmuls run as int8 x int8 at the machine's int8 rate

    def weights(self, shape: ModelShape) -> int:
        """Bytes of weights one forward reads: every layer's matmuls and norms, the final norm and
        the LM head (a tied one reads the embedding matrix)."""
        if self.file_weight_bytes is not None:
            return self.file_weight_bytes
        rows = sum(o for o, _ in shape.layer_matmuls()) * shape.num_layers + shape.vocab
        norms = (2 * shape.num_layers + 1) * shape.hidden * self.float_bytes
        return int(shape.decode_params * self.weight_bytes + rows * self.row_scale_bytes + norms)

    def kv_per_token(self, shape: ModelShape) -> float:
        """Bytes of K and V of one cached token, all layers."""
        return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * self.kv_bytes


FLOAT32 = Storage("float32 weights, float32 KV")


def kv_itemsize(dtype_name: str) -> int:
    """Bytes per element of a torch dtype name (the KV dtype)."""
    return getattr(torch, dtype_name).itemsize


def polychip_storage(dtype: str = "float32", kv: str | None = None, quantization: str | None = None) -> Storage:
    """How polychip stores a model run with ``dtype``, KV dtype ``kv`` (None: ``dtype``) and
    ``quantization`` (None, int8: int8 weights with ``dtype`` row scales, w8a8: int8 activations too,
    its matmuls at the machine's int8 rate). Both ``bench peers`` and ``bench serving`` rate polychip by it."""
    kv = kv or dtype
    compute, kv_bytes = kv_itemsize(dtype), kv_itemsize(kv)
    if quantization == "int8":
        return Storage(f"int8 weights + {dtype} row scales, {kv} KV", weight_bytes=1, row_scale_bytes=compute,
                       kv_bytes=kv_bytes, float_bytes=compute)
    if quantization == "w8a8":
        return Storage(f"int8 weights + float32 row scales, int8 activations, {kv} KV", weight_bytes=1,
                       row_scale_bytes=4, kv_bytes=kv_bytes, float_bytes=compute, int8_matmuls=True)
    if quantization is not None:
        raise ValueError(f"no roofline for quantization {quantization!r}: its scales' bytes are not modelled "
                         "(only none, int8 and w8a8)")
    return Storage(f"{dtype} weights, {kv} KV", weight_bytes=compute, kv_bytes=kv_bytes, float_bytes=compute)


@dataclass
class Machine:
    bandwidth_gbs: float      # read bandwidth
    copy_gbs: float           # copy (read + write) bandwidth
    matmul_gflops: float      # at the model's shapes
    threads: int
    device: str = "cpu"       # the torch device the ceilings were measured on
    int8_gops: float = 0.0    # W8A8 matmuls at the model's shapes (int8 ops/s); 0: not measured

    def matmul_rate(self, st: "Storage") -> float:
        """FLOP/s (or int8 op/s) of ``st``'s matmuls; a W8A8 storage needs the measured int8 rate."""
        if not st.int8_matmuls:
            return self.matmul_gflops * 1e9
        if self.int8_gops <= 0:
            raise ValueError(f"{st.label}: int8 matmuls, but the int8 rate was not measured (measure_machine(int8=True))")
        return self.int8_gops * 1e9

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


def _buffer(plugin, n: int, dtype: torch.dtype) -> torch.Tensor:
    """n elements where the engine keeps what a step reads: the plugin's ``alloc`` (the CPU plugin's is on 2 MiB
    pages, as its weights and KV pool are; a read there ran 6-24% faster than on torch's 4 KiB pages in 4 rounds
    on a Zen 3, so a ceiling on torch's memory sat below the engine's reads); torch's memory without a plugin."""
    if plugin is None:
        return torch.empty(n, dtype=dtype)
    return memory.alloc(plugin, "the roofline's bandwidth buffer", (n,), dtype)


def read_buffer(mib: int, dtype=torch.float32, plugin=None) -> torch.Tensor:
    """``mib`` MiB, filled, in the memory ``_buffer`` picks: what ``measure_read`` reads."""
    return _buffer(plugin, mib * 2**20 // torch.tensor([], dtype=dtype).element_size(), dtype).fill_(1)


def measure_read(x: torch.Tensor, reps: int, plugin=None) -> float:
    """Read GB/s: a full read (sum) of ``x`` on ``plugin``'s device, best of ``reps``."""
    return x.numel() * x.element_size() / _best(lambda: x.sum(), reps, _target(plugin)[1]) / 1e9


def measure_bandwidth(mib: int = 512, reps: int = 5, dtype=torch.float32, plugin=None) -> tuple[float, float]:
    """(read GB/s, copy GB/s) on ``plugin``'s device, in memory from its ``alloc``; best of ``reps``."""
    x = read_buffer(mib, dtype, plugin)
    read = measure_read(x, reps, plugin)
    y = _buffer(plugin, x.numel(), dtype)
    return read, 2 * x.numel() * x.element_size() / _best(lambda: y.copy_(x), reps, _target(plugin)[1]) / 1e9


def _resolve(plugin, op: str, dtype: str):
    """What the engine runs for ``op`` on ``plugin``: its own implementation, or the native one it falls back to."""
    from polychip.ops.native import register_native
    from polychip.ops.registry import OpRegistry
    registry = OpRegistry(plugin.name)
    register_native(registry)
    plugin.register_ops(registry)
    return registry.resolve(op, 1, dtype)


def _linears(plugin, dtype: torch.dtype) -> list[Callable]:
    """``F.linear`` and the device plugin's own ``linear`` op for ``dtype`` when it registers one (the
    CPU plugin's register tiles outrun torch's BLAS on AVX-512: a ceiling below what we run is no
    ceiling)."""
    own = _resolve(plugin, "linear", str(dtype).removeprefix("torch."))
    return [F.linear] + ([] if own.is_fallback else [own.fn])


def measure_matmul(shape: ModelShape, plugin, tokens: int = 512, reps: int = 5, dtype=torch.float32) -> float:
    """GFLOP/s of one layer's matmuls on ``tokens`` rows on ``plugin``'s device, best of ``reps``, by
    the faster of ``F.linear`` and the plugin's own ``linear``."""
    device, sync = _target(plugin)
    ws = [torch.randn(o, i, dtype=dtype, device=device) * 0.02 for o, i in shape.layer_matmuls()]
    xs = {i: torch.randn(tokens, i, dtype=dtype, device=device) for _, i in shape.layer_matmuls()}
    flops = sum(2 * tokens * o * i for o, i in shape.layer_matmuls())
    best = 0.0
    for linear in _linears(plugin, dtype):
        def layer():
            for w in ws:
                linear(xs[w.shape[1]], w)

        with torch.inference_mode():
            best = max(best, flops / _best(layer, reps, sync) / 1e9)
    return best


def measure_int8_matmul(shape: ModelShape, plugin, tokens: int = 512, reps: int = 5) -> float:
    """int8 GOP/s of one layer's W8A8 matmuls on ``tokens`` float32 rows, through the op the engine
    runs (the plugin's ``linear_w8a8``, or the native one it falls back to), best of ``reps``."""
    device, sync = _target(plugin)
    op = _resolve(plugin, "linear_w8a8", "float32").fn
    ws = [(torch.randint(-127, 128, (o, i), dtype=torch.int8, device=device),
           torch.rand(o, device=device) * 1e-3) for o, i in shape.layer_matmuls()]
    xs = {i: torch.randn(tokens, i, device=device) for _, i in shape.layer_matmuls()}
    ops = sum(2 * tokens * o * i for o, i in shape.layer_matmuls())

    def layer():
        for w, s in ws:
            op(xs[w.shape[1]], w, s)

    with torch.inference_mode():
        return ops / _best(layer, reps, sync) / 1e9


def measure_machine(shape: ModelShape, reps: int = 5, plugin=None, mib: int = 512, int8: bool = False) -> Machine:
    """The ceilings of ``plugin``'s device (the CPU plugin, opened once here, when None); ``int8``: the
    W8A8 rate too."""
    if plugin is None:
        from polychip.devices.discovery import open_device
        cpu = open_device("cpu")
        try:
            return measure_machine(shape, reps, cpu, mib, int8)
        finally:
            cpu.destroy()
    read, copy = measure_bandwidth(mib, reps, plugin=plugin)
    return Machine(read, copy, measure_matmul(shape, plugin, reps=reps), torch.get_num_threads(),
                   str(_target(plugin)[0]), measure_int8_matmul(shape, plugin, reps=reps) if int8 else 0.0)


def best_of(a: Machine, b: Machine) -> Machine:
    """The machine's ceiling from two measurements in one run (noise only ever slows it down)."""
    return Machine(max(a.bandwidth_gbs, b.bandwidth_gbs), max(a.copy_gbs, b.copy_gbs),
                   max(a.matmul_gflops, b.matmul_gflops), a.threads, a.device, max(a.int8_gops, b.int8_gops))


@dataclass(frozen=True)
class Step:
    """One step's roofline: the bytes it reads, its FLOPs, and the time the slower limit gives."""

    bytes: float
    flops: float
    seconds: float


def _step(nbytes: float, matmul_flops: float, attention_flops: float, m: Machine, st: Storage) -> Step:
    compute = matmul_flops / m.matmul_rate(st) + attention_flops / (m.matmul_gflops * 1e9)
    return Step(nbytes, matmul_flops + attention_flops, max(nbytes / (m.bandwidth_gbs * 1e9), compute))


def decode_step(shape: ModelShape, st: Storage, m: Machine, contexts: list[int]) -> Step:
    """A decode step of ``len(contexts)`` sequences, each attending to ``contexts[i]`` tokens (its
    cached ones and the new one): the weights once, the sequences' KV, their embedding rows."""
    tokens = sum(contexts)
    nbytes = st.weights(shape) + tokens * st.kv_per_token(shape) + len(contexts) * shape.hidden * st.float_bytes
    return _step(nbytes, len(contexts) * 2 * shape.decode_params, tokens * shape.attention_flops_per_key, m, st)


def prefill(shape: ModelShape, st: Storage, m: Machine, prompt_lens: list[int]) -> Step:
    """The prompts' prefill (no cached prefix): the weights read once, the matmuls of every
    prompt token, the LM head for each prompt's last token, causal attention over each prompt."""
    tokens = sum(prompt_lens)
    causal_keys = sum(n * (n + 1) // 2 for n in prompt_lens)
    matmuls = tokens * 2 * shape.non_embedding_params + len(prompt_lens) * 2 * shape.lm_head_params
    return _step(st.weights(shape) + tokens * shape.hidden * st.float_bytes, matmuls,
                 causal_keys * shape.attention_flops_per_key, m, st)


def single_stream_decode_ceiling(shape: ModelShape, st: Storage, m: Machine, prompt_len: int, tokens: int) -> float:
    """Tokens/s of one stream decoding ``tokens`` tokens after a ``prompt_len`` prompt (the first
    decode step attends to prompt_len + 1 tokens), every step at its roofline."""
    total = sum(decode_step(shape, st, m, [prompt_len + k]).seconds for k in range(1, tokens + 1))
    return tokens / total


def prefill_ceiling(shape: ModelShape, st: Storage, m: Machine, prompt_len: int) -> float:
    """Prompt tokens/s of one ``prompt_len`` prefill at its roofline."""
    return prompt_len / prefill(shape, st, m, [prompt_len]).seconds


def workload_seconds(shape: ModelShape, st: Storage, m: Machine, num_requests: int, input_len: int,
                     output_len: int, concurrency: int) -> dict:
    """Roofline time of ``num_requests`` requests run in waves of ``concurrency``: each wave's
    prefill, then ``output_len - 1`` decode steps (prefill gives the first token), step k of a
    wave reading every sequence's input_len + k cached tokens."""
    prefill_s = decode_s = 0.0
    read = flops = 0.0
    left = num_requests
    while left > 0:
        b = min(concurrency, left)
        p = prefill(shape, st, m, [input_len] * b)
        prefill_s, read, flops = prefill_s + p.seconds, read + p.bytes, flops + p.flops
        for k in range(1, output_len):
            d = decode_step(shape, st, m, [input_len + k] * b)
            decode_s, read, flops = decode_s + d.seconds, read + d.bytes, flops + d.flops
        left -= b
    total = prefill_s + decode_s
    return {"storage": st.label, "prefill_s": prefill_s, "decode_s": decode_s, "total_s": total,
            "output_tok_s": num_requests * output_len / total if total else 0.0,
            "bytes_read": read, "flops": flops}


# The roofline before issue 17: float32 weights only, no KV bytes, no attention FLOPs (shown once
# beside the honest one; see the module docstring).

def weights_only_decode_step_seconds(shape: ModelShape, m: Machine, batch: int) -> float:
    memory = shape.decode_weight_bytes / (m.bandwidth_gbs * 1e9)
    compute = batch * 2 * shape.decode_params / (m.matmul_gflops * 1e9)
    return max(memory, compute)


def weights_only_workload_seconds(shape: ModelShape, m: Machine, num_requests: int, input_len: int,
                                  output_len: int, concurrency: int) -> dict:
    prefill_s = num_requests * input_len * 2 * shape.non_embedding_params / (m.matmul_gflops * 1e9)
    decode_s, left = 0.0, num_requests
    while left > 0:
        b = min(concurrency, left)
        decode_s += max(output_len - 1, 0) * weights_only_decode_step_seconds(shape, m, b)
        left -= b
    total = prefill_s + decode_s
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": total,
            "output_tok_s": num_requests * output_len / total if total else 0.0,
            "single_stream_decode_tok_s": 1.0 / weights_only_decode_step_seconds(shape, m, 1)}
