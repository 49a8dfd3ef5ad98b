"""The validated settings objects: ``EngineConfig`` (model, device, KV pool, scheduler) and
``ServerConfig`` (HTTP). Each field carries its CLI help in its metadata, so the flags, defaults,
help and choices come from here alone (``polychip/flags.py`` builds them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from polychip.dtypes import KV_CACHE_DTYPES, KV_WIRE_DTYPES, MODEL_DTYPES, QUANTIZATION_DTYPES
from polychip.errors import ConfigError

# Names owned here; the scheduler and the reasoning-parser table are keyed by them (tests/test_config.py).
SCHEDULE_POLICIES = ("fcfs", "lpm")
REASONING_PARSERS = ("qwen3",)
# SGLang's --tool-call-parser names for the Hermes-style <tool_call>{json}</tool_call> format of the
# Qwen2.5 / Qwen3 templates; the parser table (server/tool_parsers.py) is keyed by them
TOOL_CALL_PARSERS = ("qwen25", "qwen")
RESERVED_TEMPLATE_ARGS = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")
LOG_LEVELS = ("debug", "info", "warning", "error")
QUANTIZATIONS = tuple(QUANTIZATION_DTYPES)    # int8 (weight-only) and the checkpoint schemes (polychip/quant)


DECODE_GROUP = "compiled decode (SGLang's flags)"
SPEC_GROUP = "speculative decoding (SGLang's flags)"
SPEC_ALGORITHMS = ("NGRAM", "SUFFIX")   # drafts from the request's own tokens; SUFFIX: and recent outputs
TP_GROUP = "tensor parallelism (SGLang's flags; --tp-size counts ranks on all nodes)"
PD_GROUP = "prefill/decode disaggregation (SGLang's flags; docs/disaggregation.md)"
PP_GROUP = "pipeline parallelism (docs/pipeline-parallel.md; --nnodes, --node-rank, --dist-* as for tp)"
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("local", "tcp", "mooncake")


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


def option(default, help: str, *, group: str, flag: str | None = None, choices: tuple | None = None):
    """A config field with its command-line face. A bool that defaults to True needs a ``--disable-*``
    flag; a tuple field is a repeatable flag."""
    return field(default=default, metadata={"help": help, "group": group, "flag": flag, "choices": choices})


def _check_min(obj, names: tuple[str, ...], low: float) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


class _FromKwargs:
    @classmethod
    def from_kwargs(cls, **kwargs):
        """Build from keyword args, rejecting unknown names with the list of known ones; None means
        the default (except for model_path, where None is the embedded model)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.__name__} argument(s) {unknown}; known: {sorted(known)}")
        for name in ("plugins", "pp_device_configs"):     # JSON and callers give lists
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(kwargs[name])
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "model_path"})


@dataclass(frozen=True)
class EngineConfig(_FromKwargs):
    # model
    model_path: str | None = option(None, "HF folder, .gguf file or .pcpkg package (default: the embedded "
                                          "SmolLM2)", group="model")
    served_model_name: str | None = option(None, "model name the API reports (default: the model path)",
                                           group="model")
    dtype: str = option("auto", "compute dtype (auto: the device's choice for the model)", group="model",
                        choices=MODEL_DTYPES)
    quantization: str | None = option(None, "default: the checkpoint's own quantization_config (compressed-tensors "
                                            "W8A8/W8A16/W4A16/FP8, GPTQ, AWQ, block FP8), else float; naming the "
                                            "checkpoint's scheme is allowed, another one is refused. On a float "
                                            "model: int8 (weight-only, per output channel, lm_head included) or "
                                            "w8a8 (int8 weights per channel and dynamic per-token int8 "
                                            "activations, embedding int8)", group="model", choices=QUANTIZATIONS)
    strict: bool = option(False, "refuse to load when an op of the model's quantisation scheme would run the "
                          "native reference because the device plugin does not implement it (named with "
                          "the scheme and the device)", group="model")
    max_model_len: int | None = option(None, "context length (default: the model's own)", group="model")
    cache_dir: str | None = option(None, "where converted GGUF weights are cached "
                                         "(default: $POLYCHIP_CACHE or ~/.cache/polychip)", group="model")
    # device
    device: str = option("auto", "auto | cpu | cuda | <plugin>[:index]", group="device")
    plugins: tuple[str, ...] = option((), "extra device plugin: module.path or path/to/plugin.py (repeatable)",
                                      group="device", flag="--plugin")
    device_config: str | None = option(None, "device spec YAML file", group="device")
    num_threads: int | None = option(None, "CPU threads for compute (default: the plugin's choice)",
                                     group="device")
    profile_stages: bool = option(False, "synchronise the device at each engine stage boundary, so that the "
                                         "per-stage times (metrics, bench) are exact on devices that run "
                                         "asynchronously (cuda); costs the overlap of host and device work",
                                  group="device")
    # KV pool
    page_size: int = option(16, "tokens per KV page", group="KV pool and scheduler")
    max_total_tokens: int | None = option(None, "KV pool size in tokens (default: from free memory)",
                                          group="KV pool and scheduler")
    mem_fraction_static: float | None = option(None, "share of free device memory for the KV pool "
                                                     "(default: the plugin's)", group="KV pool and scheduler")
    kv_cache_dtype: str = option("auto", "what the KV pool stores: auto (the compute dtype), float32, bfloat16, "
                                         "float16, or fp8 (fp8_e4m3, fp8_e5m2) with a per-layer scale of 1.0 as vLLM without "
                                         "calibration; the device must support it", group="KV pool and scheduler",
                                 choices=tuple(KV_CACHE_DTYPES))
    # scheduler
    chunked_prefill_size: int = option(512, "token budget of one step", group="KV pool and scheduler")
    max_running_requests: int = option(64, "requests decoded together at most", group="KV pool and scheduler")
    schedule_policy: str = option("fcfs", "waiting-queue order: fcfs, or lpm (longest cached prefix first)",
                                  group="KV pool and scheduler", choices=SCHEDULE_POLICIES)
    disable_radix_cache: bool = option(False, "no prefix cache", group="KV pool and scheduler")
    enable_hierarchical_cache: bool = option(False, "keep the radix cache's evicted pages in host memory (pinned "
                                                    "where the device offers it) and copy them back on a hit "
                                                    "(SGLang's flag)", group="KV pool and scheduler")
    hicache_ratio: float = option(2.0, "host tier size as a multiple of the device KV pool",
                                  group="KV pool and scheduler")
    hicache_size: float = option(0.0, "host tier size in GiB; overrides --hicache-ratio when > 0",
                                 group="KV pool and scheduler")
    enable_fusion: bool = option(True, "no fused qkv / gate-up / add+norm ops", group="KV pool and scheduler",
                                 flag="--disable-fusion")
    seed: int = option(0, "seed of the sampler's default generator", group="KV pool and scheduler")
    # the static decode path (SGLang's flags): on cpu the compiled decode step, on cuda CUDA graphs
    cuda_graph_max_bs: int | None = option(None, "largest decode batch run through the plugin's compile() on "
                                                 "fixed per-batch-size buffers (on cpu: the compiled decode step; "
                                                 "on cuda: CUDA graphs); larger batches and steps with prefill run "
                                                 "eager (default: the plugin's, cpu 16, cuda 32)", group=DECODE_GROUP)
    disable_cuda_graph: bool = option(False, "run every decode step eager (on cpu: no compiled decode step; on "
                                             "cuda: no CUDA graphs)", group=DECODE_GROUP)
    # speculative decoding (SGLang's flags; engine/spec_decode.py)
    speculative_algorithm: str | None = option(None, "NGRAM: draft tokens looked up in the request's own prompt "
                                                     "and output, verified in one forward; SUFFIX: also in the "
                                                     "outputs of recent requests (default: off)",
                                               group=SPEC_GROUP, choices=SPEC_ALGORITHMS)
    speculative_num_draft_tokens: int = option(4, "most draft tokens per step and sequence (each step verifies "
                                                  "as many as its measured cost and the acceptance so far "
                                                  "pay for); the forward checks them and the token after in one "
                                                  "pass", group=SPEC_GROUP)
    speculative_ngram_min_match_window_size: int = option(1, "shortest end of the sequence looked up for a "
                                                             "draft", group=SPEC_GROUP)
    speculative_ngram_max_match_window_size: int = option(12, "longest end of the sequence looked up (the "
                                                              "longest match wins)", group=SPEC_GROUP)
    speculative_ngram_min_acceptance: float = option(0.0, "a request whose drafts were accepted less than this "
                                                          "share over its last 8 verify steps decodes without "
                                                          "speculation from then on (polychip's flag; 0: never, "
                                                          "the cost model already drops drafts that do not pay)",
                                                     group=SPEC_GROUP)
    # tensor parallelism (SGLang's flags): tp_size counts ranks across all nodes
    tp_size: int = option(1, "ranks, one per device, that each hold 1/N of every layer", group=TP_GROUP)
    nnodes: int = option(1, "hosts; run the same command on each, with its --node-rank", group=TP_GROUP)
    node_rank: int = option(0, "this host's number; node 0 schedules and serves HTTP", group=TP_GROUP)
    dist_init_addr: str | None = option(None, "HOST:PORT where node 0 hosts the rendezvous (needed with "
                                              "--nnodes > 1)", group=TP_GROUP)
    dist_timeout: float = option(30.0, "seconds a collective waits for a peer before the group is declared "
                                       "failed", group=TP_GROUP)
    dist_init_timeout: float = option(120.0, "seconds every rank gets to join; then the missing ones are named",
                                      group=TP_GROUP)
    dist_secret: str | None = option(None, "shared secret every rank must prove at the rendezvous (visible in "
                                           "ps: prefer --dist-secret-file or $POLYCHIP_DIST_SECRET); one host "
                                           "without one: a random secret for its own ranks", group=TP_GROUP)
    dist_secret_file: str | None = option(None, "file holding the shared secret of --dist-secret", group=TP_GROUP)
    allreduce_fp32: bool = option(True, "sum bfloat16/float16 all-reduces in their own dtype, not float32",
                                  group=TP_GROUP, flag="--disable-allreduce-fp32")
    # pipeline parallelism (engine/pipeline): one model split by layers over devices, unlike ones included
    pp_size: int = option(1, "pipeline stages, one process and one device each, each holding a run of layers",
                          group=PP_GROUP)
    pp_devices: str | None = option(None, "each stage's device in stage order, e.g. cpu:0,simxpu:0 (stage 0 "
                                          "schedules, samples and holds the embedding and the lm_head)",
                                    group=PP_GROUP)
    pp_layer_split: str | None = option(None, "layers per stage, e.g. 10,20 (default: the planner's split from "
                                              "each device's declared compute, memory and bandwidth)",
                                        group=PP_GROUP)
    pp_device_configs: tuple[str, ...] = option((), "a device spec for the stages of another plugin than "
                                                    "--device-config's (repeatable)", group=PP_GROUP,
                                                flag="--pp-device-config")
    pp_micro_batches: int | None = option(None, "micro-batches in flight between the stages (default: one per "
                                                "stage; 1: the stages take turns)", group=PP_GROUP)
    pp_calibrate: bool = option(False, "plan the stages from one layer measured on each stage's device (a few "
                                       "seconds before loading) instead of the declared figures", group=PP_GROUP,
                                flag="--calibrate")
    # prefill/decode disaggregation (SGLang's flags; engine/disagg)
    disaggregation_mode: str = option("null", "null: plain serving; prefill: run prompts for decode sides and hand "
                                              "their KV over; decode: take requests whose prompt a prefill side "
                                              "runs (bootstrap_host / bootstrap_port in the request)",
                                      group=PD_GROUP, choices=DISAGGREGATION_MODES)
    disaggregation_transfer_backend: str = option("tcp", "how the KV moves: local (shared memory, one host), tcp "
                                                         "(several connections per peer), mooncake (Mooncake's "
                                                         "transfer engine, TCP protocol)",
                                                  group=PD_GROUP, choices=TRANSFER_BACKENDS)
    disaggregation_bootstrap_port: int = option(8998, "prefill side: the port decode sides connect to (0: a free "
                                                      "one, named in /server_info)", group=PD_GROUP)
    disaggregation_host: str = option("127.0.0.1", "prefill side: the address the bootstrap port listens on; "
                                                   "decode side: the address its Mooncake engine uses",
                                      group=PD_GROUP)
    disaggregation_tcp_connections: int = option(4, "tcp backend: connections per prefill/decode pair",
                                                 group=PD_GROUP)
    disaggregation_transfer_timeout: float = option(60.0, "seconds a hand-off may take from the decode side's "
                                                          "request to its ack; then both sides give up (the "
                                                          "decode side prefills the request itself)",
                                                    group=PD_GROUP)
    disaggregation_wire_dtype: str = option("auto", "KV on the wire: auto (the pools' dtypes), int8 or fp8_e4m3 "
                                                   "(a scale per token and head; about 4x fewer bytes than "
                                                   "float32). A prefill side offers it, a decode side asks "
                                                   "for it; both must declare the same",
                                            group=PD_GROUP, choices=tuple(KV_WIRE_DTYPES))
    disaggregation_buffer_mb: int = option(64, "MiB of host memory for the prefill side's staging and each "
                                               "decode side's receive ring", group=PD_GROUP)

    def __post_init__(self):
        _check_choice("dtype", self.dtype, MODEL_DTYPES)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_min(self, ("page_size", "chunked_prefill_size", "max_running_requests", "max_model_len",
                          "num_threads"), 1)
        if self.cuda_graph_max_bs is not None and (isinstance(self.cuda_graph_max_bs, bool) or
                                                   not isinstance(self.cuda_graph_max_bs, int) or
                                                   self.cuda_graph_max_bs < 1):
            raise ConfigError(f"cuda_graph_max_bs must be an integer >= 1 (the largest compiled decode batch; "
                              f"--disable-cuda-graph turns the path off), got {self.cuda_graph_max_bs!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(f"max_total_tokens ({self.max_total_tokens}) must hold at least one page "
                              f"of {self.page_size} tokens")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not isinstance(self.plugins, tuple):
            raise ConfigError("plugins must be a tuple of module paths or files")
        self._check_parallel()
        self._check_pipeline()
        self._check_speculative()
        self._check_disaggregation()
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigError("enable_hierarchical_cache keeps the radix cache's evicted pages; it cannot be used "
                              "with disable_radix_cache")
        _check_min(self, ("hicache_ratio", "hicache_size"), 0)
        if self.enable_hierarchical_cache and self.tp_size > 1:
            raise ConfigError("enable_hierarchical_cache copies rank 0's KV pool only; it cannot be used with "
                              f"tp_size {self.tp_size} yet")

    def _check_pipeline(self) -> None:
        if not isinstance(self.pp_size, int) or self.pp_size < 1:
            raise ConfigError(f"pp_size must be an integer >= 1, got {self.pp_size!r}")
        _check_min(self, ("pp_micro_batches",), 1)
        if not isinstance(self.pp_device_configs, tuple):
            raise ConfigError("pp_device_configs must be a tuple of device spec files")
        if self.pp_size == 1:
            if self.pp_devices is not None or self.pp_layer_split is not None or self.pp_device_configs \
                    or self.pp_calibrate:
                raise ConfigError("pp_devices, pp_layer_split, pp_device_configs and pp_calibrate need pp_size > 1")
            return
        if self.pp_calibrate and self.nnodes > 1:
            raise ConfigError("pp_calibrate (--calibrate) measures every stage's device from node 0, which cannot "
                              "open another node's devices: plan a multi-node group from declared figures (the "
                              "specs' compute) or name the split with pp_layer_split")
        stages = [d.strip() for d in (self.pp_devices or "").split(",") if d.strip()]
        if len(stages) != self.pp_size:
            raise ConfigError(f"pp_size {self.pp_size} needs pp_devices naming {self.pp_size} devices in stage "
                              f"order (e.g. cpu:0,simxpu:0), got {self.pp_devices!r}")
        if self.pp_size % self.nnodes:
            raise ConfigError(f"pp_size ({self.pp_size}) counts stages across all nodes and must be a multiple of "
                              f"nnodes ({self.nnodes})")
        clash = [name for name, bad in (("tp_size > 1", self.tp_size > 1),
                                        ("disaggregation_mode", self.disaggregation_mode != "null"),
                                        ("enable_hierarchical_cache", self.enable_hierarchical_cache),
                                        ("speculative_algorithm", self.speculative_algorithm is not None))
                 if bad]
        if clash:
            raise ConfigError(f"pipeline parallelism (pp_size {self.pp_size}) cannot be combined with "
                              f"{', '.join(clash)} yet")

    @property
    def pp_stage_devices(self) -> list[str]:
        """Each stage's device string, in stage order ([] without pipeline parallelism)."""
        return [d.strip() for d in (self.pp_devices or "").split(",") if d.strip()] if self.pp_size > 1 else []

    def _check_disaggregation(self) -> None:
        _check_choice("disaggregation_mode", self.disaggregation_mode, DISAGGREGATION_MODES)
        _check_choice("disaggregation_transfer_backend", self.disaggregation_transfer_backend, TRANSFER_BACKENDS)
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            raise ConfigError(f"disaggregation_bootstrap_port must be in 0..65535, got {self.disaggregation_bootstrap_port}")
        _check_choice("disaggregation_wire_dtype", self.disaggregation_wire_dtype, tuple(KV_WIRE_DTYPES))
        if self.disaggregation_wire_dtype != "auto" and self.disaggregation_mode == "null":
            raise ConfigError(f"disaggregation_wire_dtype {self.disaggregation_wire_dtype} needs a prefill or "
                              "decode side (disaggregation_mode)")
        _check_min(self, ("disaggregation_tcp_connections", "disaggregation_buffer_mb"), 1)
        if not self.disaggregation_transfer_timeout > 0:
            raise ConfigError(f"disaggregation_transfer_timeout must be > 0 seconds, got "
                              f"{self.disaggregation_transfer_timeout}")

    def _check_speculative(self) -> None:
        if self.speculative_algorithm is not None:
            _check_choice("speculative_algorithm", self.speculative_algorithm, SPEC_ALGORITHMS)
        _check_min(self, ("speculative_num_draft_tokens", "speculative_ngram_min_match_window_size"), 1)
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            raise ConfigError(f"speculative_ngram_max_match_window_size ({self.speculative_ngram_max_match_window_size})"
                              f" must be >= speculative_ngram_min_match_window_size "
                              f"({self.speculative_ngram_min_match_window_size})")
        if not 0 <= self.speculative_ngram_min_acceptance <= 1:
            raise ConfigError(f"speculative_ngram_min_acceptance must be in [0, 1], "
                              f"got {self.speculative_ngram_min_acceptance}")
        if self.speculative_num_draft_tokens >= self.chunked_prefill_size:
            raise ConfigError(f"speculative_num_draft_tokens ({self.speculative_num_draft_tokens}) must be below "
                              f"chunked_prefill_size ({self.chunked_prefill_size}), the step's token budget")

    def _check_parallel(self) -> None:
        for name in ("tp_size", "nnodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.quantization is not None and self.tp_size > 1:
            raise ConfigError(f"quantization {self.quantization!r} cannot be sharded yet: tensor parallelism "
                              f"(tp_size {self.tp_size}) runs float weights only")
        if self.tp_size % self.nnodes and self.pp_size == 1:     # pipeline stages are counted in _check_pipeline
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


@dataclass(frozen=True)
class ServerConfig(_FromKwargs):
    host: str = option("127.0.0.1", "address to listen on", group="server")
    port: int = option(30000, "port to listen on (0: a free one, named in the ready line)", group="server")
    api_key: str | None = option(None, "require 'Authorization: Bearer <key>' on the API (default: "
                                       "$POLYCHIP_SERVE_API_KEY, which keeps the key out of ps)", group="server")
    enable_metrics: bool = option(False, "serve Prometheus metrics at /metrics", group="server")
    reasoning_parser: str | None = option(None, "return <think>...</think> text as reasoning_content",
                                          group="server", choices=REASONING_PARSERS)
    max_waiting_requests: int = option(1024, "waiting-queue limit; beyond it requests get 503 with Retry-After",
                                       group="server")
    max_request_body_bytes: int = option(8 * 1024 * 1024, "larger request bodies get 413", group="server")
    graceful_shutdown_timeout: float = option(10.0, "seconds in-flight requests get to finish after "
                                                    "SIGINT/SIGTERM before they are aborted", group="server")
    log_level: str = option("info", "log level", group="server", choices=LOG_LEVELS)
    tool_call_parser: str | None = option(None, "tool-call format of the model's replies, SGLang's names "
                                                "(default: detected from the chat template)",
                                          group="server", choices=TOOL_CALL_PARSERS)
    enable_thinking: bool | None = option(None, "server-wide default of the chat template's enable_thinking "
                                                "(true / false); a request's chat_template_kwargs wins",
                                          group="server")
    default_chat_template_kwargs: dict | None = option(
        None, "JSON object of chat-template arguments for every request that does not set them, "
              "e.g. '{\"enable_thinking\": false}'", group="server")
    skip_server_warmup: bool = option(False, "report ready without the warm-up forwards (one per batch "
                                             "shape) after the model loads", group="server")
    # limits on what one request may ask
    max_tokens_default: int | None = option(
        None, "max_tokens of a chat request that gives none (default: the rest of the context, as OpenAI; "
              "text completions keep OpenAI's 16)", group="request limits")
    max_stop_strings: int = option(16, "most stop strings (and, separately, stop_token_ids) one request may "
                                       "give; more get 400", group="request limits")
    max_stop_chars: int = option(4096, "most characters all of a request's stop strings may have together; "
                                       "more get 400", group="request limits")
    special_tokens_in_content: bool = option(
        False, "read special-token text in chat messages (e.g. '<|im_end|>') as the control token; by default "
               "it is plain text and only the chat template's own markers are special", group="request limits")
    # connections
    timeout_keep_alive: float = option(5.0, "seconds an idle connection (no request under way) stays open",
                                       group="connections")
    timeout_request_header: float = option(10.0, "seconds a request's headers may take to arrive once it "
                                                 "has begun; then the connection is closed", group="connections")
    timeout_request_body: float = option(60.0, "seconds a request body may take to arrive; then 408",
                                         group="connections")
    # hardening (docs/packages.md, "Trust chain")
    ssl_certfile: str | None = option(None, "serve https with this certificate (PEM; uvicorn's ssl_certfile)",
                                      group="TLS and hardening")
    ssl_keyfile: str | None = option(None, "the private key of --ssl-certfile (PEM)", group="TLS and hardening")
    ssl_ca_certs: str | None = option(None, "CA bundle (PEM): clients must present a certificate it signed "
                                            "(mutual TLS, e.g. the router's --replica-client-cert)",
                                      group="TLS and hardening")
    seccomp: bool = option(False, "after the model is loaded and the port bound, allow only the syscalls serving "
                                  "needs (no process creation, ptrace, mount, new sockets); refused where the "
                                  "kernel or libseccomp lacks it", group="TLS and hardening")

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535 (0: a free one), got {self.port}")
        if self.reasoning_parser is not None:
            _check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        _check_choice("log_level", self.log_level, LOG_LEVELS)
        if self.tool_call_parser is not None:
            _check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        kwargs = self.default_chat_template_kwargs
        if kwargs is not None:
            if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
                raise ConfigError("default_chat_template_kwargs must be a JSON object with string keys")
            clash = sorted(set(RESERVED_TEMPLATE_ARGS) & set(kwargs))
            if clash:
                raise ConfigError(f"default_chat_template_kwargs cannot set {clash}; the server sets them")
        _check_min(self, ("max_waiting_requests", "max_request_body_bytes", "max_tokens_default",
                          "max_stop_strings", "max_stop_chars"), 1)
        _check_min(self, ("graceful_shutdown_timeout",), 0)
        for name in ("timeout_keep_alive", "timeout_request_header", "timeout_request_body"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("--ssl-certfile and --ssl-keyfile go together")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ConfigError("--ssl-ca-certs (client certificates) needs --ssl-certfile and --ssl-keyfile")

    def chat_template_defaults(self) -> dict:
        """The chat-template arguments every request starts from; --enable-thinking beats the JSON."""
        out = dict(self.default_chat_template_kwargs or {})
        if self.enable_thinking is not None:
            out["enable_thinking"] = self.enable_thinking
        return out
