"""The quantised ops: native references against plain formulas, the CPU plugin's kernels against the
native references (decode- and prefill-sized batches, ragged groups, act-order permutations)."""
from __future__ import annotations

import pytest
import torch

from polychip.devices.cpu import kernels as cpu_kernels
from polychip.devices.discovery import open_device
from polychip.ops import quant_native as qn
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry
from polychip.quant.int8 import quantize_int8

pytestmark = pytest.mark.device_independent


@pytest.fixture(scope="module")
def cpu_ops():
    if cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    reg = OpRegistry("cpu")
    register_native(reg)
    open_device("cpu").register_ops(reg)

    def get(name):
        res = reg.resolve(name, 1, "float32")
        assert res.source == "plugin:cpu", res
        return res.fn
    return get


def test_int4_packing_round_trips_and_follows_the_contract_layout():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = qn.pack_int4(q)
    assert packed.shape == (3, 32) and torch.equal(qn.unpack_int4(packed), q)
    assert packed[1, 5] == q[1, 5] | (q[1, 21] << 4)            # run 0: byte i = inputs i (low), 16 + i (high)
    assert packed[2, 16 + 3] == q[2, 32 + 3] | (q[2, 48 + 3] << 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        qn.pack_int4(torch.zeros(2, 48, dtype=torch.uint8))


def test_native_w8a8_is_the_int8_product_of_per_token_quantised_rows():
    x, w = torch.randn(5, 96), torch.randn(40, 96)
    q, s = quantize_int8(w)
    xs = x.abs().amax(1) / 127
    xq = torch.round(x / xs[:, None])
    want = (xq.double() @ q.double().t()) * xs[:, None].double() * s.double()
    torch.testing.assert_close(qn.linear_w8a8(x, q, s).double(), want, rtol=1e-5, atol=1e-5)
    assert qn.linear_w8a8(torch.zeros(2, 96), q, s).abs().max() == 0      # an all-zero row: scale 1, no NaN


def test_native_group_and_fp8_references_dequantise_as_documented():
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    scales, zeros = torch.rand(8, 2), torch.randint(0, 16, (8, 2), dtype=torch.uint8)
    w = (q.float() - zeros.float().repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    x = torch.randn(3, 64)
    torch.testing.assert_close(qn.linear_w4a16(x, qn.pack_int4(q), scales, zeros, 32), x @ w.t())
    perm = torch.randperm(64)
    torch.testing.assert_close(qn.linear_w4a16(x, qn.pack_int4(q), scales, zeros, 32, perm), x[:, perm] @ w.t())
    f8 = torch.randn(8, 64).to(torch.float8_e4m3fn)
    sinv = torch.rand(1, 2)
    wb = f8.float() * sinv.repeat_interleave(32, 1)
    torch.testing.assert_close(qn.linear_fp8_block(x, f8, sinv, 32, 32), x @ wb.t())


@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (3, 130, 128), (17, 64, 576), (80, 100, 256), (2, 1537, 576),
                                   (4, 66, 1536), (1, 7, 96)])
def test_cpu_w8a8_kernel_matches_native(cpu_ops, m, n, k):
    op = cpu_ops("linear_w8a8")
    x, b = torch.randn(m, k), torch.randn(n)
    q, s = quantize_int8(torch.randn(n, k))
    with torch.inference_mode():
        for bias in (None, b):
            torch.testing.assert_close(op(x, q, s, bias), qn.linear_w8a8(x, q, s, bias), rtol=1e-5, atol=1e-4)
        assert op(x.bfloat16(), q, s).dtype == torch.bfloat16          # other dtypes: the native op


def test_cpu_w8a8_decode_rows_get_the_bits_of_the_batched_gemm(cpu_ops):
    """Up to 4 rows (decode) take the VNNI rows on AVX512-VNNI builds, more take oneDNN's int8 GEMM: the
    int32 sums are exact both ways, so a row's output is the same to the bit whichever path it took."""
    op = cpu_ops("linear_w8a8")
    x, b = torch.randn(9, 576), torch.randn(1539)
    q, s = quantize_int8(torch.randn(1539, 576))
    with torch.inference_mode():
        batched = op(x, q, s, b)
        for m in range(1, 5):
            assert torch.equal(op(x[:m], q, s, b), batched[:m]), m


@pytest.mark.parametrize("m,n,k", [(1, 1539, 576), (2, 66, 1536), (3, 9, 576), (4, 130, 100), (5, 70, 576),
                                   (16, 131, 576), (37, 64, 960), (1, 7, 40)])
def test_cpu_w8a8_int32_sums_are_exact_for_every_int8_weight(cpu_ops, m, n, k):
    """Rows of x whose largest |value| is 127 quantise to themselves (scale 1), so with unit weight
    scales y is the exact integer product: every int8 weight (-128 too, which AVX2's sign trick cannot
    negate) against every x in [-127, 127], tiles, 1-3 leftover rows and a K that is no multiple of 32."""
    op = cpu_ops("linear_w8a8")
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randint(-127, 128, (m, k), generator=g)
    x[:, 0] = 127
    x[0, 1:] = -127                                                   # the extremes: |sum| near K * 127 * 128
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w[0] = -128
    want = (x @ w.long().t()).float()                                 # |sum| < 2^24: exact in float32
    with torch.inference_mode():
        assert torch.equal(op(x.float(), w, torch.ones(n)), want)


@pytest.mark.parametrize("m,n,k,group", [(1, 96, 64, 32), (3, 130, 128, 64), (17, 64, 576, 128), (80, 100, 256, 32),
                                         (1, 70, 576, 64), (2, 33, 512, 128), (5, 9, 512, 256),
                                         (2, 48, 96, 96)])
def test_cpu_w4a16_kernel_matches_native(cpu_ops, m, n, k, group):
    op = cpu_ops("linear_w4a16")
    x, b = torch.randn(m, k), torch.randn(n)
    qw = qn.pack_int4(torch.randint(0, 16, (n, k)))
    scales = torch.rand(n, -(-k // group))
    zeros = torch.randint(0, 16, scales.shape, dtype=torch.uint8)
    # a float32 sum of k products may differ from another order's by ~k eps max|term|: the VNNI path
    # quantises x in three int8 levels (~22 bits of the row's max), so its error scales with the row's
    # largest sum, not with each output (measured <= eps/4 of this bound over 150 draws per shape)
    atol = torch.finfo(torch.float32).eps * k * x.abs().max().item() * 15 * scales.max().item()
    with torch.inference_mode():
        for bias, perm in ((None, None), (b, torch.randperm(k))):
            want = qn.linear_w4a16(x, qw, scales, zeros, group, perm, bias)
            torch.testing.assert_close(op(x, qw, scales, zeros, group, perm, bias), want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (5, 130, 128), (70, 64, 256)])
def test_cpu_fp8_kernels_match_native(cpu_ops, m, n, k):
    x, b = torch.randn(m, k), torch.randn(n)
    w = (torch.randn(n, k) * 3).to(torch.float8_e4m3fn)
    s, sinv = torch.rand(n), torch.rand(-(-n // 32), -(-k // 128))
    with torch.inference_mode():
        torch.testing.assert_close(cpu_ops("linear_fp8")(x, w, s, b), qn.linear_fp8(x, w, s, b), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cpu_ops("linear_fp8_block")(x, w, sinv, 32, 128, b),
                                   qn.linear_fp8_block(x, w, sinv, 32, 128, b), rtol=1e-4, atol=1e-4)
