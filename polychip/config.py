"""EngineConfig: the one validated settings object. CLI flags map onto its fields."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from polychip.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8",)      # weight-only, per output channel (polychip/quant)
POLICIES = ("fcfs", "lpm")


@dataclass(frozen=True)
class EngineConfig:
    # model
    model_path: str | None = None          # None: the embedded SmolLM2-135M-Instruct GGUF
    served_model_name: str | None = None
    dtype: str = "auto"
    quantization: str | None = None        # None: the weights as stored ("int8": quantise at load)
    max_model_len: int | None = None       # None: the model's own context length
    cache_dir: str | None = None           # None: $POLYCHIP_CACHE or ~/.cache/polychip
    # device
    device: str = "auto"
    plugins: tuple[str, ...] = ()
    device_config: str | None = None
    num_threads: int | None = None
    # KV pool
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None  # None: the plugin's default fraction
    # scheduler
    chunked_prefill_size: int = 512
    max_running_requests: int = 64
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    enable_fusion: bool = True
    seed: int = 0
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    enable_metrics: bool = False
    reasoning_parser: str | None = None
    max_waiting_requests: int = 1024
    max_request_body_bytes: int = 8 * 1024 * 1024
    log_level: str = "info"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS} or unset, got {self.quantization!r}")
        if self.schedule_policy not in POLICIES:
            raise ConfigError(f"schedule_policy must be one of {POLICIES}, got {self.schedule_policy!r}")
        for name in ("page_size", "chunked_prefill_size", "max_running_requests", "max_waiting_requests",
                     "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(f"max_total_tokens ({self.max_total_tokens}) must hold at least one page "
                              f"of {self.page_size} tokens")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.reasoning_parser not in (None, "qwen3"):
            raise ConfigError(f"reasoning_parser must be 'qwen3' or unset, got {self.reasoning_parser!r}")
        if not isinstance(self.plugins, tuple):
            raise ConfigError("plugins must be a tuple of module paths or files")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword args, rejecting unknown names with the list of known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        if "plugins" in kwargs and kwargs["plugins"] is not None:
            kwargs["plugins"] = tuple(kwargs["plugins"])
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k in ("model_path",)})
