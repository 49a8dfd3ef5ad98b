"""Rewrite passes at load: expand, replace and each fusion, on their own; fused greedy == unfused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from polychip.devices.discovery import open_device
from polychip.errors import PluginError
from polychip.models.decoder import Linear, RMSNorm
from polychip.models.loader import load_model
from polychip.ops import passes
from polychip.ops.native import NATIVE_OPS, register_native
from polychip.ops.recording import RecordingRegistry
from polychip.ops.registry import OpRegistry


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from polychip.pluginkit.conformance import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def load_unfused(test_device):
    """Load a model on the test device without fusions, for the passes to work on."""
    return lambda path, registry=None: load_model(path, open_device(test_device), "float32", enable_fusion=False,
                                                  registry=registry)


def test_expand_lists_every_call_site(tiny_model, load_unfused):
    lm = load_unfused(tiny_model)
    sites = passes.expand(lm.model)
    assert passes.OpSite("embed_tokens", "embedding") in sites
    assert passes.OpSite("layers.1.self_attn", "attention") in sites
    assert passes.OpSite("layers.0.mlp.gate_proj", "linear") in sites
    assert passes.OpSite("", "linear") in sites            # the lm head in compute_logits
    linears = [s for s in sites if s.op == "linear"]
    assert len(linears) == 2 * 7 + 1 + 1                  # 7 per layer, lm_head, compute_logits


def test_expand_covers_every_op_a_real_forward_calls(tiny_model, test_device):
    from polychip.engine.coverage import one_forward
    plugin = open_device(test_device)
    reg = RecordingRegistry(plugin.name)
    register_native(reg)
    plugin.register_ops(reg)
    lm = load_model(tiny_model, plugin, "float32", enable_fusion=True, registry=reg)
    one_forward(lm, plugin)
    called = {r.name for r, _ in reg.used()}
    fused_norm = {"add_rms_norm"} if "add_rms_norm" in plugin.fusions() else set()   # what the device fuses
    assert called == {"embedding", "linear", "rms_norm", "rotary_embedding", "attention", "silu_mul"} | fused_norm
    assert called <= {s.op for s in passes.expand(lm.model)}


def test_replace_binds_the_registry_choice_once_per_op():
    reg = OpRegistry("chip")
    register_native(reg)

    def my_silu(g, u):
        return g * u

    reg.register("silu_mul", 1, "float32", my_silu)
    sites = [passes.OpSite("a", "silu_mul"), passes.OpSite("b", "silu_mul"), passes.OpSite("c", "linear")]
    ops = SimpleNamespace()
    chosen = passes.replace(sites, reg, torch.float32, ops)
    assert ops.silu_mul is my_silu and ops.linear is NATIVE_OPS["linear"]
    assert sorted(chosen) == ["linear", "silu_mul"] and chosen["linear"].is_fallback
    assert reg.stats == {"plugin": 1, "fallback": 1}
    ops16 = SimpleNamespace()
    passes.replace(sites, reg, torch.bfloat16, ops16)
    assert ops16.silu_mul is NATIVE_OPS["silu_mul"]


def test_fuse_qkv_output_equals_separate_projections(tiny_model, load_unfused):
    lm = load_unfused(tiny_model)
    attn = lm.model.layers[0].self_attn
    x = torch.randn(5, lm.config.hidden_size)
    want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
    assert passes.fuse_pattern(lm.model, "qkv") == lm.config.num_layers
    assert attn.q_proj is None and attn.k_proj is None and attn.v_proj is None
    torch.testing.assert_close(attn.qkv_proj(x), want)
    assert passes.fuse_pattern(lm.model, "qkv") == 0      # idempotent


def test_fuse_qkv_keeps_biases(model_factory, load_unfused):
    lm = load_unfused(model_factory("qwen2", False))      # qwen2 has q/k/v biases
    attn = lm.model.layers[0].self_attn
    x = torch.randn(3, lm.config.hidden_size)
    want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
    passes.fuse_pattern(lm.model, "qkv")
    assert attn.qkv_proj.bias is not None
    torch.testing.assert_close(attn.qkv_proj(x), want)


def test_fuse_gate_up_output_equals_separate_projections(tiny_model, load_unfused):
    lm = load_unfused(tiny_model)
    mlp = lm.model.layers[1].mlp
    x = torch.randn(4, lm.config.hidden_size)
    want = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)
    assert passes.fuse_pattern(lm.model, "gate_up") == lm.config.num_layers
    assert mlp.gate_proj is None and mlp.up_proj is None
    torch.testing.assert_close(mlp.gate_up_proj(x), want)


def test_fuse_add_rms_norm_needs_the_op_resolved_first(tiny_model, load_unfused):
    lm = load_unfused(tiny_model)
    norms = [m for m in lm.model.modules() if isinstance(m, RMSNorm)]
    with pytest.raises(ValueError, match="run replace"):
        passes.fuse_pattern(lm.model, "add_rms_norm", SimpleNamespace())
    assert not any(n.fused_add for n in norms)
    assert passes.fuse_pattern(lm.model, "add_rms_norm", lm.model.ops) == len(norms) == 2 * lm.config.num_layers + 1
    assert all(n.fused_add for n in norms)
    assert vars(lm.model.ops).keys() == {s.op for s in passes.expand(lm.model)}   # the op table holds only ops


def test_passes_follow_what_a_module_declares():
    """A module class the passes have never heard of: its OPS are expanded, its FUSIONS applied."""
    ops = SimpleNamespace()

    class Block(nn.Module):
        OPS = ("silu_mul",)
        FUSIONS = {"gate_up": passes.MergeLinears("ab", ("a", "b"))}

        def __init__(self):
            super().__init__()
            self.a, self.b, self.ab = Linear(ops, 8, 3, True), Linear(ops, 8, 5, True), None

    model = nn.Sequential(Block())
    for p in model.parameters():
        p.data.normal_()
    assert passes.expand(model) == [passes.OpSite("0", "silu_mul"), passes.OpSite("0.a", "linear"),
                                    passes.OpSite("0.b", "linear")]
    reg = OpRegistry("none")
    register_native(reg)
    passes.replace(passes.expand(model), reg, torch.float32, ops)
    x = torch.randn(2, 8)
    want = torch.cat([model[0].a(x), model[0].b(x)], -1)
    assert passes.fuse(model, ("qkv", "gate_up"), ops) == ["gate_up"]
    assert model[0].a is None and model[0].b is None
    torch.testing.assert_close(model[0].ab(x), want)


def test_fuse_reports_what_it_applied_and_refuses_unknown_patterns(tiny_model, load_unfused):
    lm = load_unfused(tiny_model)
    assert passes.fuse(lm.model, ("gate_up",), lm.model.ops) == ["gate_up"]
    assert passes.fuse(lm.model, ("gate_up",), lm.model.ops) == []     # nothing left to merge
    with pytest.raises(PluginError, match="unknown fusion pattern"):
        passes.fuse(lm.model, ("qkv", "magic"), lm.model.ops)


def test_merge_refuses_mismatched_linears(tiny_model, load_unfused):
    lm = load_unfused(tiny_model)
    attn, mlp = lm.model.layers[0].self_attn, lm.model.layers[0].mlp
    with pytest.raises(ValueError, match="different input sizes"):
        passes.merge_linears([attn.q_proj, mlp.down_proj])


@pytest.mark.parametrize("which", ["tiny", "qwen2"])
@pytest.mark.device_needs("fusion:qkv", "fusion:gate_up", "fusion:add_rms_norm")
def test_fused_greedy_output_equals_unfused(tiny_model, model_factory, which, test_device):
    from polychip import LLM, SamplingParams
    path = tiny_model if which == "tiny" else model_factory("qwen2", False)
    prompts = [[5, 9, 200, 17], list(range(30, 70))]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for fusion in (True, False):
        llm = LLM(path, device=test_device, enable_fusion=fusion, max_total_tokens=512)
        assert llm.engine.loaded.fusions == (["qkv", "gate_up", "add_rms_norm"] if fusion else [])
        outs[fusion] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert outs[True] == outs[False]


def test_loading_a_fused_model_does_not_import_torch_dynamo(tiny_model, test_device):
    """Fusing the structure on the meta device must not call torch.cat there: that imports torch._dynamo,
    seconds of every start and about a second of every exit."""
    import subprocess
    import sys
    code = ("import sys; from polychip import LLM; "
            f"LLM({tiny_model!r}, device={test_device!r}, max_total_tokens=64); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
