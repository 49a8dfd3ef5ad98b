"""The CUDA plugin's Triton decode attention against a float64 reference: page-table reads,
lengths, GQA groups, split-K merging and KV dtypes. On the GPU (POLYCHIP_TEST_DEVICE=cuda) it runs
compiled; elsewhere Triton's interpreter runs the same kernels on the CPU."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# on cpu and simxpu alike it runs the interpreter on the host: once is enough (the cuda run is gpu_check.sh's)
pytestmark = pytest.mark.device_independent

CHECK = textwrap.dedent('''
    import json, os, sys
    device = sys.argv[1]
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"      # before triton.jit runs: the kernels run on the CPU
    import torch
    import triton.runtime.interpreter as interp

    # triton 3.6's interpreter turns a scalar argument used as a loop bound into a Python int with
    # int() on a one-element array, which numpy >= 2.4 refuses; index its one element instead
    _patch = interp._patch_lang_tensor
    def _patch_index(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interp._patch_lang_tensor = _patch_index

    from polychip.devices.cuda_attention import paged_decode_attention

    def reference(q, kc, vc, pages, lens, scale):
        b_, h_, d_ = q.shape
        page, hkv = kc.shape[1], kc.shape[2]
        out = torch.empty(b_, h_, d_, dtype=torch.float64)
        for b in range(b_):
            n = int(lens[b])
            used = pages[b, :-(-n // page)]
            k = kc[used].reshape(-1, hkv, d_)[:n].double()
            v = vc[used].reshape(-1, hkv, d_)[:n].double()
            for h in range(h_):
                g = h // (h_ // hkv)
                out[b, h] = ((q[b, h].double() @ k[:, g].T) * scale).softmax(-1) @ v[:, g]
        return out

    results = []
    torch.manual_seed(0)
    for dtype, (b_, h_, hkv, d_, page, width) in [
            ("float32", (3, 9, 3, 64, 16, 7)),      # SmolLM2's heads: groups of 3
            ("float32", (2, 4, 4, 32, 16, 40)),     # no GQA, 8 splits
            ("float32", (2, 8, 2, 48, 12, 9)),      # a page and a head size that are no powers of two
            ("bfloat16", (3, 9, 3, 64, 16, 7)),
            ("float16", (2, 8, 2, 64, 16, 20))]:
        dt = getattr(torch, dtype)
        num_pages = b_ * width + 3
        kc = torch.randn(num_pages, page, hkv, d_).to(dt)
        vc = torch.randn(num_pages, page, hkv, d_).to(dt)
        q = torch.randn(b_, h_, d_).to(dt)
        pages = torch.randperm(num_pages)[:b_ * width].view(b_, width)   # no page shared between sequences
        lens = torch.randint(2, width * page + 1, (b_,))
        lens[0] = 1
        lens[-1] = width * page
        ref = reference(q, kc, vc, pages, lens, d_ ** -0.5)
        # every slot past a sequence's length, in its own pages and in pages it does not use, is NaN
        for b in range(b_):
            n = int(lens[b])
            for i, p in enumerate(pages[b].tolist()):
                lo = max(0, n - i * page)
                if lo < page:
                    kc[p, lo:] = float("nan")
                    vc[p, lo:] = float("nan")
        on = lambda t: t.to(device)  # noqa: E731
        got = paged_decode_attention(on(q), on(kc), on(vc), on(pages), on(lens), d_ ** -0.5).cpu()
        results.append({"dtype": dtype, "shape": [b_, h_, hkv, d_, page, width], "out_dtype": str(got.dtype),
                        "max_err": (got.double() - ref).abs().max().item()})
    print(json.dumps(results))
''')

#: float32 accumulation against float64; the low-precision outputs are rounded once at the end
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}


def test_triton_decode_attention_matches_float64(test_device):
    device = "cuda" if test_device.startswith("cuda") else "cpu"
    proc = subprocess.run([sys.executable, "-c", CHECK, device], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 5
    for r in results:
        assert r["out_dtype"] == f"torch.{r['dtype']}", r
        assert r["max_err"] <= TOLERANCE[r["dtype"]], r
