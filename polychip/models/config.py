"""ModelConfig: the decoder's shape and variant switches, from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass

from polychip.errors import ModelLoadError, UnsupportedArchitectureError

# architecture -> variant switches; one decoder serves all of them
ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False
    torch_dtype: str = "float32"
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}")
        variant = ARCHITECTURES[arch]
        try:
            heads = cfg["num_attention_heads"]
            eos = cfg.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope = cfg.get("rope_scaling") or None
            theta = cfg.get("rope_theta")
            if theta is None:  # transformers 5 writes rope_parameters
                params = cfg.get("rope_parameters") or {}
                theta = params.get("rope_theta", 10000.0)
                if params.get("rope_type", "default") != "default":
                    rope = params
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=variant["qkv_bias"] or bool(cfg.get("attention_bias", False)),
                o_bias=not variant["qkv_bias"] and bool(cfg.get("attention_bias", False)),
                qk_norm=variant["qk_norm"],
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", ""),
                rope_scaling=rope,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
