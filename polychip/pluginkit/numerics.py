"""Check a plugin's op implementations against the native reference on random inputs.

Used by ``polychip probe`` and the conformance kit. Both implementations get identical
clones of the inputs; outputs and any inputs written in place (the KV caches) are compared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from polychip.devices.ops import AttentionMetadata, PrefillSegment
from polychip.dtypes import FLOAT_DTYPES
from polychip.ops.registry import ANY_DTYPE, OpRegistry
from polychip.pluginkit.quant_samples import quant_sample_inputs

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}   # atol = rtol


@dataclass
class OpCheck:
    name: str
    version: int
    dtype: str
    status: str            # "pass", "fail" or "skip"
    max_abs_err: float = 0.0
    tolerance: float = 0.0           # atol = rtol
    worst_ratio: float = 0.0         # max over elements of |plugin - native| / (atol + rtol |native|)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def line(self) -> str:
        head = f"{self.name} v{self.version} {self.dtype}"
        if self.status == "skip":
            return f"{head}: skipped ({self.detail})"
        return (f"{head}: max |plugin - native| = {self.max_abs_err:.3g}; rule: every element within "
                f"{self.tolerance:g} + {self.tolerance:g} x |native| (allclose atol = rtol = {self.tolerance:g}), "
                f"worst at {self.worst_ratio:.2f} of its bound") + (f"; {self.detail}" if self.detail else "")


def _rope(t: int, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.outer(torch.arange(t).float() * 3, inv)
    emb = torch.cat((f, f), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _attention_inputs(r, dtype, dev):
    """One decode (6 cached tokens), one prefill chunk over a 4-token prefix, one fresh prefill."""
    h, hkv, d, page = 4, 2, 16, 4
    t = 1 + 3 + 2
    meta = AttentionMetadata(
        slot_mapping=dev(torch.tensor([5, 12, 13, 14, 16, 17])),
        num_decodes=1, decode_pages=dev(torch.tensor([[0, 1]])), decode_lens=dev(torch.tensor([6])),
        decode_mask=dev((torch.arange(8) < 6).view(1, 1, 1, 8)),
        prefills=[PrefillSegment(1, 3, 7, dev(torch.tensor([2, 3]))), PrefillSegment(4, 2, 2, dev(torch.tensor([4])))])
    return (r(t, h, d), r(t, hkv, d), r(t, hkv, d), r(6, page, hkv, d), r(6, page, hkv, d), meta, d ** -0.5)


@dataclass(frozen=True)
class AttentionCase:
    """A paged batch: decode rows of ``decode_lens`` tokens (the last one new), then prefill chunks of
    ``q_len`` new tokens over a cached ``prefix``; pages handed out in a shuffled order."""

    label: str
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    page: int = 4
    decode_lens: tuple[int, ...] = (6,)
    prefills: tuple[tuple[int, int], ...] = ()       # (prefix, q_len)
    static: bool = False                              # the compiled decode path: full width, no mask


#: the kit's attention cases beyond the small sample: long contexts (hundreds of pages, so a tiled
#: kernel's cross-tile combine runs), GQA ratios 1, 3 and 8, head sizes that are not powers of two,
#: and the static decode path (decode_mask None)
ATTENTION_CASES = (
    AttentionCase("long context: 1,500-token decode over 375 pages, 700-token prefix prefill",
                  decode_lens=(1500, 37), prefills=((700, 9),)),
    AttentionCase("MHA (GQA ratio 1), head size 80", heads=4, kv_heads=4, head_dim=80, page=16,
                  decode_lens=(130, 5), prefills=((33, 17), (0, 12))),
    AttentionCase("GQA ratio 3, head size 112", heads=6, kv_heads=2, head_dim=112, page=8,
                  decode_lens=(300,), prefills=((100, 31),)),
    AttentionCase("GQA ratio 8 (one KV head), head size 72", heads=8, kv_heads=1, head_dim=72, page=16,
                  decode_lens=(520, 64, 3)),
    AttentionCase("static decode path (decode_mask None, full width), 600 tokens", decode_lens=(600, 250, 1),
                  page=16, static=True),
)


def _case_inputs(case: AttentionCase, r, dev, g) -> tuple:
    lens = [n for n in case.decode_lens] + [p + q for p, q in case.prefills]
    counts = [-(-n // case.page) for n in lens]
    order = torch.randperm(sum(counts) + 1, generator=g)[1:].tolist()      # page 0 stays padding only
    tables, at = [], 0
    for c in counts:
        tables.append(order[at:at + c])
        at += c
    slot = lambda pages, pos: pages[pos // case.page] * case.page + pos % case.page  # noqa: E731
    slots = [slot(tables[i], n - 1) for i, n in enumerate(case.decode_lens)]
    prefills, start = [], len(case.decode_lens)
    for j, (prefix, q_len) in enumerate(case.prefills):
        pages = tables[len(case.decode_lens) + j]
        slots += [slot(pages, prefix + t) for t in range(q_len)]
        prefills.append(PrefillSegment(start, q_len, prefix + q_len, dev(torch.tensor(pages))))
        start += q_len
    b = len(case.decode_lens)
    width = max(counts[:b]) if b else 0
    decode = {}
    if b:
        padded = torch.zeros(b, width, dtype=torch.int64)
        for i in range(b):
            padded[i, :counts[i]] = torch.tensor(tables[i])
        lens_t = torch.tensor(case.decode_lens)
        mask = None if case.static else dev((torch.arange(width * case.page) < lens_t[:, None]).view(b, 1, 1, -1))
        decode = dict(decode_pages=dev(padded), decode_lens=dev(lens_t), decode_mask=mask)
    meta = AttentionMetadata(slot_mapping=dev(torch.tensor(slots)), num_decodes=b, prefills=prefills, **decode)
    t, n_pages = len(slots), sum(counts) + 1
    h, hkv, d = case.heads, case.kv_heads, case.head_dim
    return (r(t, h, d), r(t, hkv, d), r(t, hkv, d), r(n_pages, case.page, hkv, d), r(n_pages, case.page, hkv, d),
            meta, d ** -0.5)


def attention_cases(dtype: str, device_put: Callable = lambda t: t, seed: int = 0) -> list[tuple[str, tuple]]:
    """(label, attention inputs) for every case of ATTENTION_CASES in ``dtype``."""
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return device_put(torch.randn(*shape, generator=g).to(tdt))

    return [(c.label, _case_inputs(c, r, device_put, g)) for c in ATTENTION_CASES]


def sample_inputs(name: str, dtype: str, device_put: Callable, seed: int = 0) -> tuple | None:
    """Random inputs for op ``name`` (version 1) in ``dtype``, or None when there is no recipe."""
    if dtype not in FLOAT_DTYPES:
        return None
    g = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)

    def r(*shape):
        return device_put(torch.randn(*shape, generator=g).to(tdt))

    t, hid = 5, 32
    if name == "linear":
        return r(t, hid), r(24, hid), r(24)
    if name == "linear_int8":       # int8 weights with per-row scales, activations in dtype
        q = device_put(torch.randint(-127, 128, (24, hid), generator=g, dtype=torch.int8))
        scales = device_put((torch.rand(24, generator=g) * 0.02 + 0.001).to(tdt))
        return r(t, hid), q, scales, r(24)
    if name == "embedding":
        return device_put(torch.randint(0, 50, (t,), generator=g)), r(50, hid)
    if name == "rms_norm":
        return r(t, hid), device_put(torch.rand(hid, generator=g).add(0.5).to(tdt)), 1e-6
    if name == "add_rms_norm":
        return r(t, hid), r(t, hid), device_put(torch.rand(hid, generator=g).add(0.5).to(tdt)), 1e-6
    if name == "silu_mul":
        return r(t, 48), r(t, 48)
    if name == "rotary_embedding":
        cos, sin = _rope(t, 16, tdt)
        return r(t, 4, 16), r(t, 2, 16), device_put(cos), device_put(sin)
    if name == "attention":
        return _attention_inputs(r, tdt, device_put)
    return quant_sample_inputs(name, tdt, g, device_put)


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def kv_attention_inputs(dtype: str, kv_dtype: str, device_put: Callable, seed: int = 0) -> tuple[tuple, dict]:
    """The attention sample with its caches stored in ``kv_dtype`` (as the engine's write path
    stores them), and the keywords an fp8 pool passes (scales other than 1, so they must be read)."""
    from polychip.ops.attention import to_stored
    q, k, v, kc, vc, meta, scale = sample_inputs("attention", dtype, device_put, seed)
    kv = getattr(torch, kv_dtype)
    fp8 = kv.is_floating_point and kv.itemsize == 1
    k_scale, v_scale = (0.5, 2.0) if fp8 else (1.0, 1.0)
    args = (q, k, v, to_stored(kc, kv, k_scale), to_stored(vc, kv, v_scale), meta, scale)
    return args, ({"k_scale": k_scale, "v_scale": v_scale} if fp8 else {})


def compare(name: str, version: int, dtype: str, plugin_fn: Callable, native_fn: Callable,
            device_put: Callable = lambda t: t, seed: int = 0, kv_dtype: str | None = None,
            case: tuple[str, tuple] | None = None) -> OpCheck:
    """The plugin's op against the native one on the same random inputs; for attention with
    ``kv_dtype``, on caches stored in that dtype; with ``case`` (label, args), on those inputs."""
    kwargs = {}
    if case is not None:
        args = case[1]
        dtype = f"{dtype}, {case[0]}"
    elif kv_dtype is not None:
        args, kwargs = kv_attention_inputs(dtype, kv_dtype, device_put, seed)
        dtype = f"{dtype}, {kv_dtype} KV"
    else:
        args = sample_inputs(name, dtype, device_put, seed) if version == 1 else None
    if args is None:
        return OpCheck(name, version, dtype, "skip", detail=f"no sample inputs for {name} v{version} {dtype}")
    tol = TOLERANCE[dtype.split(",")[0]]
    ref_args, got_args = _clone(args), _clone(args)
    ref = native_fn(*ref_args, **kwargs)
    try:
        got = plugin_fn(*got_args, **kwargs)
    except Exception as e:  # a plugin kernel may raise anything
        return OpCheck(name, version, dtype, "fail", tolerance=tol, detail=f"raised {type(e).__name__}: {e}")
    want, have = _tensors((ref, ref_args)), _tensors((got, got_args))
    if len(want) != len(have):
        return OpCheck(name, version, dtype, "fail", tolerance=tol,
                       detail=f"returned {len(_tensors(got))} tensors, native returns {len(_tensors(ref))}")
    worst, ratio, problems = 0.0, 0.0, []
    for i, (a, b) in enumerate(zip(want, have)):
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"tensor {i}: {tuple(b.shape)} {b.dtype}, expected {tuple(a.shape)} {a.dtype}")
            continue
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.dtype.itemsize == 1 and a.dtype.is_floating_point:    # an fp8 cache: compare the values stored
            a, b = a.float(), b.float()
        a, b = a.double(), b.double()
        if not torch.isfinite(b).all():
            problems.append(f"tensor {i} has non-finite values")
            continue
        if a.numel():
            worst = max(worst, (a - b).abs().max().item())
            ratio = max(ratio, ((a - b).abs() / (tol + tol * a.abs())).max().item())
        if not torch.allclose(b, a, atol=tol, rtol=tol):
            problems.append(f"tensor {i} differs beyond tolerance")
    return OpCheck(name, version, dtype, "fail" if problems else "pass", worst, tol, ratio, "; ".join(problems))


def check_registered_ops(registry: OpRegistry, dtypes: tuple[str, ...],
                         device_put: Callable = lambda t: t,
                         kv_cache_dtypes: Callable[[str], tuple[str, ...]] | None = None) -> list[OpCheck]:
    """Every plugin-registered op against native; '*' entries are checked in each float dtype given.
    The plugin's attention is also checked on every other KV dtype ``kv_cache_dtypes`` (the plugin's
    declaration) lists for that compute dtype."""
    results = []
    for name, version, dtype in registry.plugin_ops():
        fn = registry.plugin_fn(name, version, dtype)
        if (name, version) not in registry.native_ops():
            results.append(OpCheck(name, version, dtype, "skip", detail="no native reference to compare with"))
            continue
        native = registry.native(name, version)
        for dt in ([d for d in dtypes if d in FLOAT_DTYPES] if dtype == ANY_DTYPE else [dtype]):
            results.append(compare(name, version, dt, fn, native, device_put))
            if name == "attention" and version == 1:
                results += [compare(name, version, dt, fn, native, device_put, case=c)
                            for c in attention_cases(dt, device_put)]
            if name == "attention" and version == 1 and kv_cache_dtypes is not None:
                for kv in dict.fromkeys(kv_cache_dtypes(dt)):
                    if kv != dt:
                        results.append(compare(name, version, dt, fn, native, device_put, kv_dtype=kv))
    return results
