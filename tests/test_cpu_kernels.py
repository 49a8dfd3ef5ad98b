"""The CPU plugin's C++ kernels against the native PyTorch ops they replace."""
import os
import pytest
import torch
import torch.nn.functional as F

from polychip.devices.cpu import kernels as cpu_kernels, ops as cpu_ops
from polychip.devices.ops import AttentionMetadata
from polychip.ops.attention import decode_attention, paged_attention
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry

from attention_helpers import mixed_batch, prefill_segments

kernels = cpu_kernels.load()
NATIVE = OpRegistry("cpu")             # the registry the plugin takes its native ops from
register_native(NATIVE)
pytestmark = [pytest.mark.device_independent,     # the CPU plugin's own kernels (conftest.py)
              pytest.mark.skipif(kernels is None, reason="CPU kernels did not build here (see the log)")]


def _decode_case(heads, kv_heads, d, lengths, page=16, seed=0):
    """Paged caches with pages in random order, the native op's result and the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = int((lens.max() + page - 1) // page)
    pages = max(64, width * len(lengths) // 2)
    kc, vc = torch.randn(pages, page, kv_heads, d, generator=g), torch.randn(pages, page, kv_heads, d, generator=g)
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in lens])
    mask = (torch.arange(width * page)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=len(lens),
                             decode_pages=table, decode_lens=lens, decode_mask=mask)
    q = torch.randn(len(lens), heads, d, generator=g)
    scale = d ** -0.5
    return decode_attention(q, kc, vc, meta, scale), (q, kc, vc, table, lens, scale)


def _with_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d", [32, 64, 128, 24])        # 24: the portable (non-AVX-512) path
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (16, 2)])
def test_paged_decode_attention_matches_native(heads, kv_heads, d, threads):
    # lengths around a page and a 16-token block, and long ones that are cut into pieces
    want, args = _decode_case(heads, kv_heads, d, [1, 15, 16, 17, 700, 2000, 33])
    got = _with_threads(threads, lambda: kernels.paged_decode_attention(*args))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    q, kc, vc, table, lens, scale = args
    with pytest.raises(RuntimeError, match="page id"):
        kernels.paged_decode_attention(q, kc, vc, table + kc.shape[0], lens, scale)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", list(range(1, 18)))
def test_paged_decode_attention_batches(batch, threads):
    lengths = [(97 * i) % 900 + 1 for i in range(1, batch + 1)]
    want, args = _decode_case(9, 3, 64, lengths, seed=batch)
    got = _with_threads(threads, lambda: kernels.paged_decode_attention(*args))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page", [1, 5, 32])
def test_paged_decode_attention_page_sizes(page):
    want, args = _decode_case(9, 3, 64, [1, 33, 100, 700], page=page)
    torch.testing.assert_close(kernels.paged_decode_attention(*args), want, atol=1e-5, rtol=1e-5)


# (q_len, kv_len): one-token chunks, chunks ending just before, on and after a page or a 16-token
# boundary, whole prompts (q_len == kv_len), and long prefixes cut into many key and query blocks
PREFILL_SPECS = [(1, 1), (1, 17), (15, 16), (16, 16), (17, 17), (16, 33), (33, 100), (100, 100), (3, 700),
                 (200, 1000)]


def _prefill_case(heads, kv_heads, d, specs, page, seed=0, first_row=5):
    """Segments at their own offsets in one flat batch (rows before first_row and between the
    segments belong to nobody), caches with pages in random order, and SDPA's result on each
    segment's gathered pages with a causal mask offset by its prefix."""
    g = torch.Generator().manual_seed(seed)
    widths = [(kv + page - 1) // page for _, kv in specs]
    pool = sum(widths) + 3
    kc, vc = torch.randn(pool, page, kv_heads, d, generator=g), torch.randn(pool, page, kv_heads, d, generator=g)
    perm = torch.randperm(pool, generator=g)
    segs, start = prefill_segments(perm, specs, page, first_row)
    q = torch.randn(start, heads, d, generator=g)
    scale = d ** -0.5
    want = {}
    for s in segs:
        ks = kc[s.pages].reshape(-1, kv_heads, d)[:s.kv_len].transpose(0, 1)[None]
        vs = vc[s.pages].reshape(-1, kv_heads, d)[:s.kv_len].transpose(0, 1)[None]
        qs = q[s.start:s.start + s.q_len].transpose(0, 1)[None]
        mask = torch.arange(s.kv_len)[None, :] <= torch.arange(s.q_len)[:, None] + (s.kv_len - s.q_len)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[None, None], scale=scale,
                                           enable_gqa=heads != kv_heads)
        want[s.start] = o[0].transpose(0, 1)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), prefills=segs)
    return want, meta, (q, kc, vc, scale)


def _run_prefill(meta, q, kc, vc, scale, fill=7.0):
    out = torch.full_like(q, fill)
    segments, table = meta.prefill_tables()
    kernels.paged_prefill_attention(q, kc, vc, out, segments, table, scale)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("d", [24, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (16, 2)])
def test_paged_prefill_attention_matches_sdpa(heads, kv_heads, d, page, threads):
    want, meta, (q, kc, vc, scale) = _prefill_case(heads, kv_heads, d, PREFILL_SPECS, page, seed=d + page)
    got = _with_threads(threads, lambda: _run_prefill(meta, q, kc, vc, scale))
    mine = torch.zeros(q.shape[0], dtype=torch.bool)
    for s in meta.prefills:
        torch.testing.assert_close(got[s.start:s.start + s.q_len], want[s.start], atol=1e-5, rtol=1e-5)
        mine[s.start:s.start + s.q_len] = True
    assert (got[~mine] == 7.0).all()                          # rows of no segment are left alone


@pytest.mark.parametrize("page", [1, 5, 16])
@pytest.mark.parametrize("q_len", [1, 2, 15, 16, 17, 31, 48, 65])
def test_paged_prefill_attention_chunk_sizes(q_len, page):
    """Every chunk after prefixes off, on and past page and block boundaries; one segment per call."""
    for prefix in (0, 1, page - 1, page, 63, 64, 65):
        want, meta, (q, kc, vc, scale) = _prefill_case(9, 3, 64, [(q_len, prefix + q_len)], page, seed=q_len)
        s = meta.prefills[0]
        got = _run_prefill(meta, q, kc, vc, scale)[s.start:s.start + s.q_len]
        torch.testing.assert_close(got, want[s.start], atol=1e-5, rtol=1e-5)


def test_paged_prefill_attention_large_scores():
    """Scores tens apart (a near one-hot softmax, earlier key blocks rescaled by ~e^-50) and very
    negative ones: no NaN, and as close to a float64 reference as float32 SDPA gets (rounding in
    scores of size ~100 is amplified by exp, so both are off by ~1e-5 there)."""
    want, meta, (q, kc, vc, scale) = _prefill_case(9, 3, 64, [(40, 300), (64, 64)], 16, seed=3)
    q.mul_(30.0)
    kc[:, :, 0].mul_(-4.0)
    got = _run_prefill(meta, q, kc, vc, scale)
    assert torch.isfinite(got).all()
    for s in meta.prefills:
        ks = kc[s.pages].reshape(-1, 3, 64)[:s.kv_len].transpose(0, 1)[None]
        vs = vc[s.pages].reshape(-1, 3, 64)[:s.kv_len].transpose(0, 1)[None]
        qs = q[s.start:s.start + s.q_len].transpose(0, 1)[None]
        mask = (torch.arange(s.kv_len)[None, :] <= torch.arange(s.q_len)[:, None] + (s.kv_len - s.q_len))[None, None]
        exact = F.scaled_dot_product_attention(qs.double(), ks.double(), vs.double(), scale=scale, attn_mask=mask,
                                               enable_gqa=True)[0].transpose(0, 1)
        sdpa = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        sdpa_err = (sdpa.double() - exact).abs().max().item()
        err = (got[s.start:s.start + s.q_len].double() - exact).abs().max().item()
        assert sdpa_err > 1e-6 and err <= 2 * sdpa_err, (err, sdpa_err)


def test_paged_prefill_attention_bad_input():
    _, meta, (q, kc, vc, scale) = _prefill_case(9, 3, 64, [(3, 20), (4, 4)], 16)
    segments, table = meta.prefill_tables()
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="page id"):
        kernels.paged_prefill_attention(q, kc, vc, out, segments, table + kc.shape[0], scale)
    with pytest.raises(RuntimeError, match="out of its block table"):
        kernels.paged_prefill_attention(q, kc, vc, out, segments + torch.tensor([0, 0, 40]), table, scale)
    with pytest.raises(RuntimeError, match="rows out of q"):
        kernels.paged_prefill_attention(q, kc, vc, out, segments + torch.tensor([q.shape[0], 0, 0]), table, scale)
    with pytest.raises(RuntimeError, match="more queries than keys"):
        kernels.paged_prefill_attention(q, kc, vc, out, segments + torch.tensor([0, 5, 0]), table, scale)
    with pytest.raises(RuntimeError, match="out must have"):
        kernels.paged_prefill_attention(q, kc, vc, out[1:], segments, table, scale)


def test_prefill_tables_are_built_once_per_step():
    _, meta, _ = _prefill_case(4, 4, 24, [(3, 20), (4, 4), (1, 40)], 16)
    segments, table = meta.prefill_tables()
    assert meta.prefill_tables()[1] is table                   # the step's other layers reuse them
    assert segments.tolist() == [[s.start, s.q_len, s.kv_len] for s in meta.prefills]
    for row, s in zip(table, meta.prefills):
        assert row[:len(s.pages)].tolist() == s.pages.tolist() and (row[len(s.pages):] == 0).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_plugin_attention_mixed_batch_matches_native(threads):
    """The plugin's attention op on decodes plus prefill chunks (new K/V written to the pool first),
    against the native op on a copy of the pool; q not contiguous."""
    g = torch.Generator().manual_seed(threads)
    page, heads, kv_heads, d = 16, 9, 3, 64
    pool = 40
    kc, vc = torch.randn(pool, page, kv_heads, d, generator=g), torch.randn(pool, page, kv_heads, d, generator=g)
    perm = torch.randperm(pool, generator=g)
    # two decodes (kv 30 and 17), then chunks of 20 after a 45-token prefix and of 9 with none
    meta, start = mixed_batch(perm, [(30, 1), (17, 1), (65, 20), (9, 9)], page)
    q = torch.randn(heads, start, d, generator=g).transpose(0, 1)       # [T, H, D], not contiguous
    k, v = torch.randn(start, kv_heads, d, generator=g), torch.randn(start, kv_heads, d, generator=g)
    attention = cpu_ops.make_ops(kernels, NATIVE.native)["attention"]
    with torch.inference_mode():
        want = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, d ** -0.5)
        got = _with_threads(threads, lambda: attention(q, k, v, kc, vc, meta, d ** -0.5))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert meta.prefill_table is not None                     # the kernel path ran


def test_attention_is_the_registrys_frame_with_the_kernels_as_its_halves():
    seen = {}

    def frame(*args, decode_fn, prefill_fn):
        seen.update(args=args, decode_fn=decode_fn, prefill_fn=prefill_fn)
        return "framed"

    ops = cpu_ops.make_ops(kernels, lambda name: frame if name == "attention" else NATIVE.native(name))
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long))     # no decode rows
    args = ("q", "k", "v", "kc", "vc", meta, 0.5)
    assert ops["attention"](*args) == "framed" and seen["args"] == args
    assert callable(seen["decode_fn"]) and callable(seen["prefill_fn"])


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("n,k", [(7, 13), (96, 64), (200, 1000)])
def test_linear_blocks_matches_f_linear(m, n, k):
    torch.manual_seed(m)
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    for block in (1, 64, 4096):
        torch.testing.assert_close(kernels.linear_blocks(x, w, b, block), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536), (37, 100), (50, 33), (13, 17), (5, 7), (9, 16), (8, 1)])
def test_linear_tiles_matches_f_linear(n, k):
    """Every M up to 70 (tile tails in M), prefill-sized M (x in blocks of rows, the last one short), N
    off the tile and chunk sizes, K off the vector width."""
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k), torch.randn(n)
    tol = dict(atol=1e-4 * (k / 100) ** 0.5, rtol=1e-5)          # fp32 sums of k products of N(0, 1)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):                                    # one thread: no chunks handed out
            torch.set_num_threads(threads)
            for m in [*(range(1, 71) if n * k < 10**5 else (1, 2, 3, 4, 5, 7, 16, 17, 64, 70)), 150, 301]:
                x = torch.randn(m, k)
                torch.testing.assert_close(kernels.linear_tiles(x, w, b), F.linear(x, w, b), **tol)
                torch.testing.assert_close(kernels.linear_tiles(x, w, None), F.linear(x, w), **tol)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else True,
                    reason="AVX2 and portable builds use BLAS blocks at prefill sizes")
def test_plugin_linears_give_a_row_the_same_bits_at_prefill_size():
    """float32 and int8 weights tile at every M on AVX-512 builds: a row of a prefill chunk (or a decode row
    in a mixed step) gets the bits it would get alone (BLAS, used above 64 rows before, gives others)."""
    from polychip.quant.int8 import quantize_int8
    ops = cpu_ops.make_ops(kernels, NATIVE.native) | cpu_ops.make_int8_ops(kernels, NATIVE.native)
    torch.manual_seed(0)
    x, w = torch.randn(300, 576), torch.randn(960, 576)
    q, s = quantize_int8(w)
    with torch.inference_mode():
        for m in (65, 300):
            assert torch.equal(ops["linear"](x[:m], w)[-1], ops["linear"](x[m - 1:m], w)[0]), m
            assert torch.equal(ops["linear_int8"](x[:m], q, s)[-1], ops["linear_int8"](x[m - 1:m], q, s)[0]), m


@pytest.mark.parametrize("n,k", [(3072, 576), (962, 576), (150, 1536), (30, 100)])
def test_decode_sized_linears_give_a_row_its_own_bits(n, k):
    """Decode-sized M > 1 runs its passes over groups of weight-row tiles (each pass over the group before
    the next): every row still gets the bits it gets alone (M = 1), float32 and int8, one and two threads
    (N off the group, tile and chunk sizes; K off the vector width)."""
    from polychip.quant.int8 import quantize_int8
    torch.manual_seed(n + k)
    x, w, b = torch.randn(64, k), torch.randn(n, k), torch.randn(n)
    q, s = quantize_int8(w)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            alone = [(kernels.linear_tiles(x[i:i + 1], w, b), kernels.linear_int8_tiles(x[i:i + 1], q, s, b))
                     for i in range(64)]
            for m in (2, 5, 16, 64):
                f, i8 = kernels.linear_tiles(x[:m], w, b), kernels.linear_int8_tiles(x[:m], q, s, b)
                for r in range(m):
                    assert torch.equal(f[r], alone[r][0][0]) and torch.equal(i8[r], alone[r][1][0]), (threads, m, r)
    finally:
        torch.set_num_threads(before)


def test_linear_tiles_empty_sizes():
    w, b = torch.randn(4, 0), torch.randn(4)
    torch.testing.assert_close(kernels.linear_tiles(torch.randn(3, 0), w, b), b.expand(3, 4))
    torch.testing.assert_close(kernels.linear_tiles(torch.randn(3, 0), w, None), torch.zeros(3, 4))
    assert kernels.linear_tiles(torch.randn(0, 5), torch.randn(4, 5), None).shape == (0, 4)


def test_plugin_linear_non_contiguous_and_bias():
    ops = cpu_ops.make_ops(kernels, NATIVE.native)
    w = torch.randn(24, 40).t()                               # [40, 24], not contiguous
    b = torch.randn(80)[::2]                                  # not contiguous
    with torch.inference_mode():
        for m in (1, 3, 16, 17):
            x = torch.randn(24, m).t()                        # [m, 24], not contiguous
            torch.testing.assert_close(ops["linear"](x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ops["linear"](x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
        x0 = torch.randn(0, 24)
        assert ops["linear"](x0, w, b).shape == (0, 40)


def test_plugin_linear_routes_by_batch_size():
    ops = cpu_ops.make_ops(kernels, NATIVE.native)
    w = torch.randn(32, 24)
    with torch.inference_mode():
        for m in (1, 2, cpu_ops.TILES_MAX_M, cpu_ops.TILES_MAX_M + 1):
            x = torch.randn(m, 24)
            torch.testing.assert_close(ops["linear"](x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
        x3 = torch.randn(2, 3, 24)                       # not 2-D: the native op
        torch.testing.assert_close(ops["linear"](x3, w), F.linear(x3, w))


def test_kernels_off_is_a_visible_fallback(model_factory, monkeypatch):
    from polychip.devices.cpu import kernels as cpu_kernels, ops as cpu_ops
    from polychip.devices.cpu import CpuPlugin
    from polychip.models.loader import load_model
    monkeypatch.setenv("POLYCHIP_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})     # forget this process's earlier build
    # int8 weights: the model resolves linear_int8 as well as linear (the tied logits' op)
    loaded = load_model(model_factory("llama", True), CpuPlugin(), "float32", quantization="int8")
    from polychip.devices.ops import QUANT_OPS
    assert set(cpu_ops.OPS) - set(QUANT_OPS) <= set(loaded.resolutions)   # every float kernel op is used
    assert set(cpu_ops.OPS) <= set(loaded.registry.unavailable())         # the scheme ops say so too
    for op in set(cpu_ops.OPS) & set(loaded.resolutions):
        res = loaded.resolutions[op]
        assert res.is_fallback and "cannot provide" in res.reason and "POLYCHIP_CPU_KERNELS=0" in res.reason


def test_linear_blocks_in_inference_mode():
    """The blocks' BLAS calls write an inference tensor on the pool's threads, which must see the mode."""
    x, w = torch.randn(80, 64), torch.randn(300, 64)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.linear_blocks(x, w, None, 64), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_an_earlier_build_is_imported_directly_and_a_broken_one_is_rebuilt(tmp_path, caplog):
    from polychip.devices.cpu import kernels as cpu_kernels
    assert cpu_kernels._import_built("nothing_here", str(tmp_path / "missing.so")) is None
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"half a build")
    assert cpu_kernels._import_built("broken", str(broken)) is None
    assert "did not import" in caplog.text and "building again" in caplog.text
    built = kernels.__file__                                   # this process's module came from its build folder
    assert cpu_kernels._import_built(kernels.__name__, built).linear_tiles is not None


def test_a_library_built_in_this_process_is_known_by_its_bytes(tmp_path, monkeypatch):
    """After a build (not an import of an earlier one) the library's sha256 is recorded: pins see it, and
    importing the same file again gives the loaded module instead of a second dlopen, whose op library
    would register twice and abort the process."""
    import hashlib
    import types
    from torch.utils import cpp_extension
    built = types.SimpleNamespace(linear_tiles="the built module")

    def build(name, sources, build_directory, **kw):
        (tmp_path / f"{name}.so").write_bytes(b"freshly built bytes")
        return built
    monkeypatch.setattr(cpu_kernels, "_state", {})             # this process has loaded nothing yet
    monkeypatch.setattr(cpu_kernels, "_by_digest", {})
    monkeypatch.setattr(cpu_kernels, "_name", lambda: "fresh")
    monkeypatch.setattr(cpu_kernels, "_build_dir", lambda name: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.delenv("POLYCHIP_CPU_KERNELS", raising=False)
    assert cpu_kernels.load() is built
    assert cpu_kernels.loaded_sha256() == hashlib.sha256(b"freshly built bytes").hexdigest()
    assert cpu_kernels._import_built("fresh", str(tmp_path / "fresh.so")) is built


@pytest.mark.parametrize("n", [1, 8, 23, 48, 49, 100, 3072])
def test_decode_row_linears_cover_every_weight_row_in_thread_shares(n):
    """At M = 1 each intra-op thread walks its own share of the weight-row chunks, then helps with the
    other's: every row computed once, with the bits one thread gives (N below, at and off the chunk and
    tile sizes, an odd number of chunks to share)."""
    from polychip.quant.int8 import quantize_int8
    torch.manual_seed(n)
    k = 576 if n < 3072 else 1536
    x, w, b = torch.randn(1, k), torch.randn(n, k), torch.randn(n)
    q, s = quantize_int8(w)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((kernels.linear_tiles(x, w, b), kernels.linear_int8_tiles(x, q, s, b)))
    finally:
        torch.set_num_threads(before)
    (f1, i1), (f2, i2) = results
    tol = dict(atol=1e-4 * (k / 100) ** 0.5, rtol=1e-5)
    torch.testing.assert_close(f2, F.linear(x, w, b), **tol)
    torch.testing.assert_close(i2, F.linear(x, q.float() * s.unsqueeze(1), b), **tol)
    assert torch.equal(f1, f2) and torch.equal(i1, i2)
