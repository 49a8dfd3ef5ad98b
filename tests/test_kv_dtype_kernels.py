"""KV caches in bfloat16 and fp8 at the op level: the CPU plugin's decode and prefill kernels and the
native attention, each against a float64 reference computed on the values the pool stores (stored
value x scale), so these tests see only the kernels' own arithmetic, not the storage rounding."""
import pytest
import torch

from polychip.devices.cpu import kernels as cpu_kernels, ops as cpu_ops
from polychip.devices.ops import AttentionMetadata
from polychip.ops import attention as native_attention
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry

from attention_helpers import mixed_batch, prefill_segments

kernels = cpu_kernels.load()
NATIVE = OpRegistry("cpu")
register_native(NATIVE)
pytestmark = pytest.mark.device_independent     # the CPU plugin's kernels and the native op, on the CPU

KV_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
needs_kernels = pytest.mark.skipif(kernels is None, reason="CPU kernels did not build here (see the log)")


def _stored(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return native_attention.to_stored(x, dtype, scale)


def _values(shape, g, spread: bool) -> torch.Tensor:
    """Normal values, or with ``spread`` magnitudes over 2^-14 .. 2^5: fp8's subnormals, its normal
    range and e4m3's clamp at 448 (with the scale below) all occur."""
    x = torch.randn(*shape, generator=g)
    if spread:
        x = x * torch.exp2(torch.randint(-14, 6, shape, generator=g).float())
    return x


def _reference_decode(q, kc, vc, table, lens, scale, k_scale, v_scale):
    page, hkv, d = kc.shape[1:]
    flat_k = kc.reshape(-1, hkv, d).double() * k_scale
    flat_v = vc.reshape(-1, hkv, d).double() * v_scale
    group = q.shape[1] // hkv
    out = []
    for b, length in enumerate(lens.tolist()):
        t = torch.arange(length)
        rows = table[b][t // page] * page + t % page
        k = flat_k[rows].repeat_interleave(group, 1)
        v = flat_v[rows].repeat_interleave(group, 1)
        w = (torch.einsum("hd,thd->ht", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", w, v))
    return torch.stack(out)


def _decode_case(dtype, heads, kv_heads, d, lengths, page=16, seed=0, k_scale=1.0, v_scale=1.0, spread=False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = int((lens.max() + page - 1) // page)
    pages = max(8, width * len(lengths))
    kc = _stored(_values((pages, page, kv_heads, d), g, spread), dtype, k_scale)
    vc = _stored(_values((pages, page, kv_heads, d), g, spread), dtype, v_scale)
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in lengths])
    for b, length in enumerate(lengths):        # past each sequence's last page: ids out of the pool
        table[b, (length + page - 1) // page:] = 1 << 40
    q = torch.randn(len(lengths), heads, d, generator=g)
    return q, kc, vc, table, lens, d ** -0.5


def _close(got, want, v_scale):
    # float32 arithmetic on exactly widened values; outputs are of the size of v_scale x |v|
    torch.testing.assert_close(got.double(), want, atol=3e-5 * max(1.0, v_scale), rtol=2e-5)


LENGTHS = [1, 3, 16, 17, 33, 64, 129, 300]


@needs_kernels
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("d", [16, 64, 80, 128, 24])      # 80: 2 streams; 24: the portable path
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_kernel_reads_each_kv_dtype(dtype, d, threads):
    k_scale, v_scale = (0.37, 1.9) if dtype.itemsize == 1 else (1.0, 1.0)
    args = _decode_case(dtype, 9, 3, d, LENGTHS, seed=d, k_scale=k_scale, v_scale=v_scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.paged_decode_attention(*args, k_scale, v_scale)
    finally:
        torch.set_num_threads(before)
    _close(got, _reference_decode(*args, k_scale, v_scale), v_scale)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("d", [64, 24])
def test_decode_kernel_fp8_subnormals_and_clamp(dtype, d):
    """Values spread over fp8's whole range: subnormals widen exactly (the kernel goes through fp16
    bits, never a float32 subnormal), and values clamped at the format's top come back as stored."""
    args = _decode_case(dtype, 4, 2, d, [5, 40, 257], seed=7, k_scale=0.05, v_scale=0.05, spread=True)
    kc = args[1]
    assert (kc.view(torch.uint8) & 0x7F).min() < 8       # subnormal codes are in the cache
    got = kernels.paged_decode_attention(*args, 0.05, 0.05)
    _close(got, _reference_decode(*args, 0.05, 0.05), 0.05)


def _prefill_case(dtype, heads, kv_heads, d, specs, page, seed=0, k_scale=1.0, v_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    widths = [(kv + page - 1) // page for _, kv in specs]
    pool = sum(widths) + 3
    kc = _stored(torch.randn(pool, page, kv_heads, d, generator=g), dtype, k_scale)
    vc = _stored(torch.randn(pool, page, kv_heads, d, generator=g), dtype, v_scale)
    perm = torch.randperm(pool, generator=g)
    segs, start = prefill_segments(perm, specs, page, first_row=3)
    q = torch.randn(start, heads, d, generator=g)
    return q, kc, vc, segs


def _reference_prefill(q, kc, vc, seg, scale, k_scale, v_scale):
    hkv, d = kc.shape[2:]
    ks = (kc[seg.pages].reshape(-1, hkv, d)[:seg.kv_len].double() * k_scale).repeat_interleave(q.shape[1] // hkv, 1)
    vs = (vc[seg.pages].reshape(-1, hkv, d)[:seg.kv_len].double() * v_scale).repeat_interleave(q.shape[1] // hkv, 1)
    qs = q[seg.start:seg.start + seg.q_len].double()
    s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
    mask = torch.arange(seg.kv_len)[None, :] <= torch.arange(seg.q_len)[:, None] + (seg.kv_len - seg.q_len)
    w = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", w, vs)


PREFILL_SPECS = [(1, 1), (15, 16), (17, 17), (16, 33), (33, 100), (100, 100), (3, 300)]


@needs_kernels
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 24])
@pytest.mark.parametrize("page", [1, 16])
def test_prefill_kernel_reads_each_kv_dtype(dtype, d, page):
    k_scale, v_scale = (0.37, 1.9) if dtype.itemsize == 1 else (1.0, 1.0)
    q, kc, vc, segs = _prefill_case(dtype, 9, 3, d, PREFILL_SPECS, page, seed=d + page, k_scale=k_scale,
                                    v_scale=v_scale)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), prefills=segs)
    out = torch.full_like(q, 7.0)
    segments, table = meta.prefill_tables()
    kernels.paged_prefill_attention(q, kc, vc, out, segments, table, d ** -0.5, k_scale, v_scale)
    mine = torch.zeros(q.shape[0], dtype=torch.bool)
    for s in segs:
        want = _reference_prefill(q, kc, vc, s, d ** -0.5, k_scale, v_scale)
        _close(out[s.start:s.start + s.q_len], want, v_scale)
        mine[s.start:s.start + s.q_len] = True
    assert (out[~mine] == 7.0).all()


@needs_kernels
def test_kernels_refuse_other_kv_dtypes_and_mixed_caches():
    q, kc, vc, table, lens, scale = _decode_case(torch.bfloat16, 4, 2, 64, [5])
    with pytest.raises(RuntimeError, match="k_cache must be float32, bfloat16, float8_e4m3fn or float8_e5m2"):
        kernels.paged_decode_attention(q, kc.half(), vc.half(), table, lens, scale)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.paged_decode_attention(q, kc, vc.float(), table, lens, scale)


def test_write_path_quantises_once_and_clamps():
    """write_kv stores k / scale in the pool's dtype, clamped to the format's top (not NaN); the
    bytes written are exactly to_stored's, and no other slot changes."""
    g = torch.Generator().manual_seed(0)
    for dtype in KV_DTYPES:
        kc = torch.zeros(4, 8, 2, 16, dtype=dtype)
        vc = torch.zeros_like(kc)
        k = torch.randn(3, 2, 16, generator=g) * 300
        v = torch.randn(3, 2, 16, generator=g)
        slots = torch.tensor([5, 17, 30])
        native_attention.write_kv(k, v, kc, vc, AttentionMetadata(slot_mapping=slots), k_scale=0.5, v_scale=2.0)
        flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
        scale_k, scale_v = (0.5, 2.0) if dtype.itemsize == 1 else (1.0, 1.0)
        assert torch.equal(flat_k[slots].view(torch.uint8) if dtype.itemsize == 1 else flat_k[slots],
                           _stored(k, dtype, scale_k).view(torch.uint8) if dtype.itemsize == 1
                           else _stored(k, dtype, scale_k))
        assert torch.isfinite(flat_k.float()).all() and torch.isfinite(flat_v.float()).all()
        assert (flat_k.float().abs().amax() <= torch.finfo(dtype).max)
        others = torch.ones(flat_k.shape[0], dtype=torch.bool)
        others[slots] = False
        assert (flat_k[others].float() == 0).all() and (flat_v[others].float() == 0).all()
        got = native_attention.from_stored(flat_v[slots], torch.float32, scale_v)
        assert (got - v).abs().max() <= v.abs().max() * (0.13 if dtype == torch.float8_e5m2 else 0.07)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_native_attention_matches_the_reference_on_a_mixed_batch(dtype):
    """The native op (the fallback every other plugin runs) on decodes plus prefill chunks, one of
    them with no cached prefix: it writes k, v in the pool's dtype, converts only the pages it
    gathers, and the no-prefix chunk attends to its k, v as stored."""
    g = torch.Generator().manual_seed(1)
    page, heads, kv_heads, d = 8, 4, 2, 32
    k_scale, v_scale = (0.37, 1.9) if dtype.itemsize == 1 else (1.0, 1.0)
    kc = _stored(torch.randn(30, page, kv_heads, d, generator=g), dtype, k_scale)
    vc = _stored(torch.randn(30, page, kv_heads, d, generator=g), dtype, v_scale)
    perm = torch.randperm(30, generator=g)
    meta, start = mixed_batch(perm, [(21, 1), (40, 12), (9, 9)], page)
    table, lens, prefills = meta.decode_pages, meta.decode_lens, meta.prefills
    q = torch.randn(start, heads, d, generator=g)
    k, v = torch.randn(start, kv_heads, d, generator=g), torch.randn(start, kv_heads, d, generator=g)
    kw = {"k_scale": k_scale, "v_scale": v_scale} if dtype.itemsize == 1 else {}
    with torch.inference_mode():
        got = native_attention.paged_attention(q, k, v, kc, vc, meta, d ** -0.5, **kw)
        want = torch.empty(q.shape, dtype=torch.float64)
        want[:1] = _reference_decode(q[:1], kc, vc, table, lens, d ** -0.5, k_scale, v_scale)
        for s in prefills:
            want[s.start:s.start + s.q_len] = _reference_prefill(q, kc, vc, s, d ** -0.5, k_scale, v_scale)
        assert got.dtype == torch.float32
        _close(got, want, v_scale)
        if kernels is not None:    # the CPU plugin's op: the same frame with the kernels as its halves
            attention = cpu_ops.make_ops(kernels, NATIVE.native)["attention"]
            _close(attention(q, k, v, kc, vc, meta, d ** -0.5, **kw), want, v_scale)


def test_the_kit_checks_attention_on_every_declared_kv_dtype():
    """The conformance kit's op check runs a plugin's attention on each KV dtype it declares: one
    that ignores the fp8 scales fails there, and only there."""
    from polychip.pluginkit.numerics import check_registered_ops

    def checks(attention):
        registry = OpRegistry("fake")
        register_native(registry)
        registry.register("attention", 1, "float32", attention)
        return {c.dtype: c for c in check_registered_ops(
            registry, ("float32",), kv_cache_dtypes=lambda dt: (dt, "bfloat16", "float8_e4m3fn"))}

    from polychip.pluginkit.numerics import ATTENTION_CASES
    native = NATIVE.native("attention")
    good = checks(native)
    assert set(good) == {"float32", "float32, bfloat16 KV", "float32, float8_e4m3fn KV"} | {
        f"float32, {c.label}" for c in ATTENTION_CASES}           # and the kit's larger attention cases
    assert all(c.ok for c in good.values())
    bad = checks(lambda *args, k_scale=1.0, v_scale=1.0: native(*args))    # drops the scales
    assert bad["float32"].ok and bad["float32, bfloat16 KV"].ok and not bad["float32, float8_e4m3fn KV"].ok
