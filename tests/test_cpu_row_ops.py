"""The CPU plugin's fused row ops (devices/cpu/csrc/elementwise.cpp) against the native PyTorch ops."""
import pytest
import torch

from polychip.devices.cpu import kernels as cpu_kernels, row_ops as cpu_row_ops
from polychip.ops import native
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry

kernels = cpu_kernels.load()
pytestmark = [pytest.mark.device_independent,     # the CPU plugin's own kernels (conftest.py)
              pytest.mark.skipif(kernels is None, reason="CPU kernels did not build here (see the log)")]
registry = OpRegistry("cpu")
register_native(registry)
ops = cpu_row_ops.make_ops(kernels, registry.native) if kernels is not None else {}


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_row_ops_match_native_on_fused_projection_slices(rows, threads):
    torch.manual_seed(rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            gate, up = torch.randn(rows, 2 * 1536).split([1536, 1536], -1)     # column slices, row stride 3072
            torch.testing.assert_close(ops["silu_mul"](gate, up), native.silu_mul(gate, up))
            x, res, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
            torch.testing.assert_close(ops["rms_norm"](x, w, 1e-5), native.rms_norm(x, w, 1e-5))
            for got, want in zip(ops["add_rms_norm"](x, res, w, 1e-5), native.add_rms_norm(x, res, w, 1e-5)):
                torch.testing.assert_close(got, want)
            q, k, _ = torch.randn(rows, 960).split([576, 192, 192], -1)
            q, k = q.view(rows, 9, 64), k.view(rows, 3, 64)
            cos, sin = torch.randn(rows, 64), torch.randn(rows, 64)
            for got, want in zip(ops["rotary_embedding"](q, k, cos, sin), native.rotary_embedding(q, k, cos, sin)):
                torch.testing.assert_close(got, want)
                assert got.is_contiguous()
            qn = torch.randn(64)                                               # Qwen3 q_norm on [T, H, D] slices
            torch.testing.assert_close(ops["rms_norm"](q, qn, 1e-6), native.rms_norm(q, qn, 1e-6))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cols", [1, 7, 8, 13, 1536])
def test_silu_mul_over_the_whole_range_and_row_tails(cols):
    """Large |g| on both sides (sigmoid saturates, e^g would overflow), zeros, and rows whose tail is shorter
    than a vector: the same values as the native op."""
    torch.manual_seed(cols)
    gate = torch.cat([torch.randn(3, cols) * 4, torch.full((1, cols), 95.0), torch.full((1, cols), -95.0),
                      torch.full((1, cols), -0.0), torch.linspace(-120, 120, cols).unsqueeze(0)])
    up = torch.randn_like(gate)
    with torch.inference_mode():
        got = kernels.silu_mul(gate, up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(got[3], 95.0 * up[3])                    # sigmoid(95) is 1 in float32
    assert got[4].abs().max() < 1e-30 and (got[5] == 0).all()           # sigmoid(-95) ~ 6e-42; g = -0


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX2",
                    reason="the AVX2 row's promise; AVX-512 builds compute silu with their own float polynomial")
def test_avx2_silu_mul_keeps_a_correctly_rounded_exp_s_bits():
    """The AVX2 row rounds e^-g once from double, so its outputs are those of a correctly rounded expf followed
    by the same float32 ops (libm's expf, which the portable loop used, nearly always): W8A8 models, chaotic
    under 1-ulp changes in silu, keep their tokens (a float polynomial changed 37% of the outputs)."""
    torch.manual_seed(0)
    gate = torch.cat([torch.randn(64, 1536) * 3, torch.linspace(-110, 110, 1536).unsqueeze(0)])
    up = torch.randn_like(gate)
    with torch.inference_mode():
        got = kernels.silu_mul(gate, up)
    assert torch.equal(got, gate / (1 + torch.exp(-gate.double()).float()) * up)


def test_row_ops_leave_their_inputs_untouched():
    x, res, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    x0, res0 = x.clone(), res.clone()
    with torch.inference_mode():
        ops["add_rms_norm"](x, res, w, 1e-6)
    assert torch.equal(x, x0) and torch.equal(res, res0)


def test_row_ops_take_the_native_path_for_other_dtypes():
    x, w = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = ops["rms_norm"](x, w, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, native.rms_norm(x, w, 1e-6))


def test_row_op_kernels_name_a_bad_shape():
    with pytest.raises(RuntimeError, match="one value per column"):
        kernels.rms_norm(torch.randn(4, 32), torch.randn(31), 1e-6)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernels.rotary_embedding(torch.randn(2, 4, 8), torch.randn(2, 1, 8), torch.randn(2, 6), torch.randn(2, 6))


def test_row_ops_fall_back_to_the_native_ops_the_registry_hands_over():
    calls = []

    def native_op(name):
        def counted(*args):
            calls.append(name)
            return registry.native(name)(*args)
        return counted

    mine = cpu_row_ops.make_ops(kernels, native_op)
    x, w = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    with torch.inference_mode():
        mine["rms_norm"](x, w, 1e-6)                       # bf16: not the kernel's
        mine["rms_norm"](x.float(), w.float(), 1e-6)       # fp32: the kernel
    assert calls == ["rms_norm"]
