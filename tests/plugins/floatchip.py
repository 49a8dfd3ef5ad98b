"""floatchip: a small fixture plugin written from docs/plugin-guide.md alone, with its own paged
attention (decode and prefill halves inside the native frame), float32 and bfloat16 only: no int8,
no fp8 KV cache, no float16. The whole device suite runs on it
(``POLYCHIP_PLUGINS=tests/plugins/floatchip.py POLYCHIP_TEST_DEVICE=floatchip``), skipping with this
plugin's own reasons what it declares it cannot do. Host memory stands for the card (4 GiB)."""
from __future__ import annotations

import torch

from polychip.devices import Availability, DeviceInfo, DevicePlugin, Event, Stream
from polychip.devices.ops import AttentionMetadata

CARD_BYTES = 4 * 2**30
DTYPES = ("float32", "bfloat16")


class _Stream(Stream):
    def synchronize(self) -> None:
        pass


class _Event(Event):
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _gather(cache: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` tokens of a sequence's pages: [n, Hkv, D] in float32."""
    return cache[pages].reshape(-1, *cache.shape[2:])[:n].float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_from: int | None) -> torch.Tensor:
    """q [Tq, H, D] over k, v [Tk, Hkv, D] (GQA by repeating kv heads); causal for the last Tq keys."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal_from is not None:
        tq, tk = q.shape[0], k.shape[0]
        allowed = torch.arange(tk)[None, :] <= (causal_from + torch.arange(tq))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, **_):
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(meta.decode_lens[b])
        pages = meta.decode_pages[b, :-(-n // k_cache.shape[1])]
        out[b] = _attend(q[b:b + 1], _gather(k_cache, pages, n), _gather(v_cache, pages, n), scale, None)[0]
    return out


def prefill_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, out, **_):
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.q_len)
        keys, vals = _gather(k_cache, seg.pages, seg.kv_len), _gather(v_cache, seg.pages, seg.kv_len)
        out[rows] = _attend(q[rows], keys, vals, scale, seg.kv_len - seg.q_len).to(out.dtype)


class FloatChipPlugin(DevicePlugin):
    name = "floatchip"
    plugin_version = "0.1"
    torch_device_type = "cpu"
    priority = 2

    def __init__(self):
        super().__init__()
        self.used = 0

    def is_available(self) -> Availability:
        return Availability(True)

    def discover(self) -> list[DeviceInfo]:
        total = self.spec.memory.total if self.spec is not None else CARD_BYTES
        return [DeviceInfo(index=0, name="FloatChip", total_memory=total, free_memory=total - self.used,
                           dtypes=DTYPES, topology={"p2p_enabled": False})]

    def device_handle(self, index=None) -> torch.device:
        return torch.device("cpu")

    def alloc(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        if self.used + t.nbytes > self.discover()[0].total_memory:
            raise MemoryError(f"floatchip: {t.nbytes} bytes requested, {self.mem_info()[0]} free")
        self.used += t.nbytes
        return t

    def free(self, tensor) -> None:
        self.used -= tensor.nbytes

    def mem_info(self) -> tuple[int, int]:
        total = self.discover()[0].total_memory
        return total - self.used, total

    def synchronize(self) -> None:
        pass

    def stream(self) -> Stream:
        return _Stream()

    def event(self) -> Event:
        return _Event()

    def register_ops(self, registry) -> None:
        frame = registry.native("attention")
        for dtype in DTYPES:
            registry.register("attention", 1, dtype, lambda *a, **kw: frame(
                *a, decode_fn=decode_attention, prefill_fn=prefill_attention, **kw))
        registry.register_unavailable("linear_int8", "floatchip has no int8 matmul units")
