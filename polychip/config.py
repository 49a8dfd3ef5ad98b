"""EngineConfig: the one validated settings object. CLI flags map onto its fields."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from polychip.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("fcfs", "lpm")


def parse_host_port(text: str, what: str = "address") -> tuple[str, int]:
    """'10.0.0.1:5000' or '[::1]:5000' -> (host, port); a ConfigError naming ``what`` otherwise."""
    s = str(text)
    if s.startswith("["):
        host, sep, port = s[1:].partition("]:")
    else:
        host, sep, port = s.rpartition(":")
    if not sep or not host or (":" in host and not s.startswith("[")) or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be HOST:PORT with a port in 1..65535 (IPv6 as [ADDR]:PORT), got {text!r}")
    return host, int(port)


@dataclass(frozen=True)
class EngineConfig:
    # model
    model_path: str | None = None          # None: the embedded SmolLM2-135M-Instruct GGUF
    served_model_name: str | None = None
    dtype: str = "auto"
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
    # tensor parallelism (SGLang's names): tp_size counts ranks across all nodes
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None      # HOST:PORT of node 0's rendezvous; needed with nnodes > 1
    dist_timeout: float = 30.0             # seconds a collective waits for a peer before failing
    dist_init_timeout: float = 120.0       # seconds every rank gets to join the world
    allreduce_fp32: bool = True            # bfloat16/float16 all-reduces accumulate in float32
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
        self._check_parallel()

    def _check_parallel(self) -> None:
        for name in ("tp_size", "nnodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.tp_size % self.nnodes:
            raise ConfigError(f"tp_size ({self.tp_size}) counts ranks across all nodes and must be a multiple of "
                              f"nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in 0..{self.nnodes - 1} for nnodes {self.nnodes}, "
                              f"got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ConfigError(f"nnodes {self.nnodes} needs dist_init_addr HOST:PORT (node 0's address, the same "
                              "on every node)")
        if self.dist_init_addr is not None:
            parse_host_port(self.dist_init_addr, "dist_init_addr")
        for name in ("dist_timeout", "dist_init_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

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
