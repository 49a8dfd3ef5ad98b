"""The CPU plugin's decode-only attention step in one call (``paged_decode_attention_kv``): this step's
K/V rows stored at their slots (float32 or bfloat16 pool), then the decode kernel over the pool. Checked
against the registry's frame (write_kv's cast and index_copy_, then the same decode kernel) bit for bit,
cache and output, and against a float64 reference on the stored values."""
import pytest
import torch

from polychip.devices.cpu import kernels as cpu_kernels, ops as cpu_ops
from polychip.devices.ops import AttentionMetadata
from polychip.ops.attention import paged_attention
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry

kernels = cpu_kernels.load()
NATIVE = OpRegistry("cpu")
register_native(NATIVE)
pytestmark = [pytest.mark.device_independent,     # the CPU plugin's own kernels (conftest.py)
              pytest.mark.skipif(kernels is None, reason="CPU kernels did not build here (see the log)")]


def _step(dtype, lengths, heads=9, kv_heads=3, d=64, page=16, seed=0):
    """A pool with pages in random order and a decode step whose new token is each row's last one;
    k, v [B, Hkv, D] are views into one qkv row each, as the model's split hands them over."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = int((lens.max() + page - 1) // page)
    pages = width * len(lengths) + 3
    kc = torch.randn(pages, page, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(pages, page, kv_heads, d, generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[:width * len(lengths)].view(len(lengths), width)
    last = lens - 1
    slots = table[torch.arange(len(lengths)), last // page] * page + last % page
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=len(lengths), decode_pages=table, decode_lens=lens)
    qkv = torch.randn(len(lengths), heads + 2 * kv_heads, d, generator=g)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], 1)
    return q.contiguous(), k, v, kc, vc, meta, d ** -0.5


def _reference(q, kc, vc, meta, scale):
    page, hkv, d = kc.shape[1:]
    flat_k, flat_v = kc.reshape(-1, hkv, d).double(), vc.reshape(-1, hkv, d).double()
    out = []
    for b, length in enumerate(meta.decode_lens.tolist()):
        t = torch.arange(length)
        rows = meta.decode_pages[b][t // page] * page + t % page
        k = flat_k[rows].repeat_interleave(q.shape[1] // hkv, 1)
        v = flat_v[rows].repeat_interleave(q.shape[1] // hkv, 1)
        w = (torch.einsum("hd,thd->ht", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", w, v))
    return torch.stack(out).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1], [800], [33, 1, 300, 17]])
def test_one_call_stores_and_attends_as_the_frame_does(dtype, lengths, threads):
    q, k, v, kc, vc, meta, scale = _step(dtype, lengths, seed=len(lengths) + threads)
    attention = cpu_ops.make_ops(kernels, NATIVE.native)["attention"]
    frame_decode = lambda *a, **kw: kernels.paged_decode_attention(a[0], a[1], a[2], a[3].decode_pages,  # noqa: E731
                                                                   a[3].decode_lens, a[4])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            kf, vf = kc.clone(), vc.clone()
            want = paged_attention(q, k, v, kf, vf, meta, scale, decode_fn=frame_decode)
            got = attention(q, k, v, kc, vc, meta, scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(kc, kf) and torch.equal(vc, vf)          # the same stored bits, in the same slots
    assert torch.equal(got, want)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, scale), atol=3e-5, rtol=2e-5)


def test_a_decode_step_records_one_call_for_its_kv_write_and_attention():
    """A replay pays one dispatched call per recorded op: the frame's KV write was a cast and an
    index_copy_ per cache (4 calls a layer at batch 1), now part of the attention kernel's call."""
    import polychip.devices.cpu.compiled_step as cs
    table = cpu_ops.KernelTable(kernels)
    attention = cpu_ops.make_ops(table, NATIVE.native)["attention"]
    q, k, v, kc, vc, meta, scale = _step(torch.bfloat16, [40])
    recorder = cs._Recorder()
    with torch.inference_mode(), table.as_operators(), recorder:
        attention(q, k, v, kc, vc, meta, scale)
    assert [str(c[0]) for c in recorder.calls] == ["polychip_cpu.paged_decode_attention_kv.default"]


def test_bfloat16_rows_round_as_torch_casts():
    """Ties to even, NaN, infinities, subnormals and the largest values, stored as .to(bfloat16) stores them."""
    q, k, v, kc, vc, meta, scale = _step(torch.bfloat16, [5, 9], kv_heads=1, heads=1, d=16)
    special = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), float("nan"), float("inf"),
                            -float("inf"), 1e-40, -3e-39, 3.3895e38, 3.4e38, 0.0, -0.0, 2 ** -133, 1.00390625,
                            1.01171875, 65504.0])
    k = torch.stack([special, special.flip(0)]).view(2, 1, 16)
    with torch.inference_mode():
        kernels.paged_decode_attention_kv(q, k, v.contiguous(), kc, vc, meta.slot_mapping, meta.decode_pages,
                                          meta.decode_lens, scale)
    stored = kc.view(-1, 1, 16)[meta.slot_mapping]
    assert torch.equal(stored.view(torch.int16), k.to(torch.bfloat16).view(torch.int16))


def test_bad_slots_and_pools_are_refused_before_anything_is_written():
    q, k, v, kc, vc, meta, scale = _step(torch.bfloat16, [5])
    before = kc.clone()
    for slots in (torch.tensor([kc.shape[0] * kc.shape[1]]), torch.tensor([-1]), torch.tensor([0, 1])):
        with pytest.raises(RuntimeError, match="slot"):
            kernels.paged_decode_attention_kv(q, k, v, kc, vc, slots, meta.decode_pages, meta.decode_lens, scale)
    fp8 = kc.to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.paged_decode_attention_kv(q, k, v, fp8, fp8.clone(), meta.slot_mapping, meta.decode_pages,
                                          meta.decode_lens, scale)
    assert torch.equal(kc, before)


def test_fp8_pools_keep_the_frame():
    """An fp8 pool (with its scales) takes the frame's write_kv (a clamp and a byte copy), then the kernel."""
    q, k, v, kc, vc, meta, scale = _step(torch.float32, [20, 7])
    fp8k, fp8v = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    wk, wv = fp8k.clone(), fp8v.clone()
    attention = cpu_ops.make_ops(kernels, NATIVE.native)["attention"]

    def decode(qq, kk, vv, m, s, k_scale, v_scale):
        return kernels.paged_decode_attention(qq, kk, vv, m.decode_pages, m.decode_lens, s, k_scale, v_scale)

    with torch.inference_mode():
        got = attention(q, k, v, fp8k, fp8v, meta, scale, k_scale=0.5, v_scale=0.25)
        want = paged_attention(q, k, v, wk, wv, meta, scale, decode_fn=decode, k_scale=0.5, v_scale=0.25)
    assert torch.equal(got, want)
    assert torch.equal(fp8k.view(torch.uint8), wk.view(torch.uint8))
