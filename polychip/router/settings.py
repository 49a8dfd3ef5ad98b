"""The router's settings: one pydantic model, one set of defaults and limits.

The deployment file's ``router:`` section is this model (its errors name the file and the field); the
command line's flags are generated from it (settings_flags.py); flags given on the command line win over
the file. Every field says whether a reload (``/admin/reload``, SIGHUP) may change it while the router runs
(``live``); ``reload_changes`` refuses the others, naming them. ``LiveSettings`` holds the settings in
force: every part reads them there, so what a reload changes is what the router then does.
"""
from __future__ import annotations

from typing import Annotated, Callable

from pydantic import Field, field_validator, model_validator

from polychip.errors import ConfigError
from polychip.router.settings_base import PRIORITY_CLASSES, _Settings, setting, settings_message  # noqa: F401
from polychip.router.settings_placement import PlacementConfig, SloTargets  # noqa: F401
DEFAULT_PRIORITY_WEIGHTS = {"high": 3.0, "normal": 1.0, "low": 1.0}
# priority_class -> the replica scheduler's integer ``priority`` (lower runs first)
DEFAULT_REPLICA_PRIORITIES = {"high": -10, "normal": 0, "low": 10}
POLICY_NAMES = ("round_robin", "least_load", "prefix_aware", "fastest")


class HealthConfig(_Settings):
    interval: float = setting(5.0, "seconds between checks of each replica", flag="--health-check-interval",
                              gt=0, le=300)
    timeout: float = setting(5.0, "seconds one check may take", flag="--health-check-timeout", gt=0)
    failure_threshold: int = setting(3, "consecutive failed checks that mark a replica down", ge=1)
    success_threshold: int = setting(2, "consecutive good checks that bring it back", ge=1)


class GuardConfig(_Settings):
    """When a canary version is rolled back (its weight set to 0). Every attempt counts against the
    version that served it, retried or not (overload refusals and client disconnects are left out),
    and a version whose replicas all have open circuits is failing; the error test is a Wilson
    bound, so one unlucky error in a small sample does not fire."""

    max_error_rate: float = setting(0.01, "the Wilson lower bound of a canary's error rate must stay under it",
                                    ge=0, lt=1)
    confidence: float = setting(0.95, "confidence of that bound", ge=0.5, lt=1)
    min_samples: int = setting(50, "requests per version (in the window) before the guard judges", ge=1)
    max_ttft_ratio: float = setting(2.0, "canary TTFT p95 / baseline TTFT p95 that rolls it back", gt=1)
    max_tpot_ratio: float = setting(1.5, "canary time-per-output-token p95 / baseline's that rolls it back", gt=1)
    window: float = setting(300.0, "seconds of recent outcomes the guard judges", gt=0)


class BreakerConfig(_Settings):
    """Per-replica circuit breaker from request outcomes (sgl-router's defaults where it has the
    setting: failure_threshold 5, success_threshold 2, open 30 s, window 60 s), outlier ejection by
    failure rate, and the retry budget."""

    failure_threshold: int = setting(5, "failures in a row that open a replica's circuit", ge=1)
    success_threshold: int = setting(2, "half-open probe successes that close it", ge=1)
    open_seconds: float = setting(30.0, "seconds open before half-open probes", gt=0)
    window: float = setting(60.0, "seconds over which failure rates and the retry budget count", gt=0)
    failure_rate: float = setting(0.5, "outlier ejection: this failure rate over the window opens the circuit ...",
                                  gt=0, le=1)
    min_requests: int = setting(20, "... once the window holds this many outcomes", ge=1)
    half_open_probes: int = setting(1, "requests let through at once while half-open", ge=1)
    retry_budget_ratio: float = setting(0.2, "retries may add this fraction of the window's requests ...", ge=0)
    retry_budget_min: int = setting(10, "... or this many retries, whichever is more", ge=0)


class PrefixConfig(_Settings):
    """prefix_aware: follow the longest cached prefix unless the load is out of balance."""

    match_threshold: float = setting(0.3, "matched fraction of the prompt that counts as a hit", ge=0, le=1)
    balance_abs: int = setting(8, "imbalance: max load - min load above this ...", ge=0)
    balance_rel: float = setting(1.5, "... and max load above this times min load", ge=1)
    max_chars_per_replica: int = setting(2_000_000, "prompt characters the tree keeps per replica", ge=1)
    prompt_chars: int = setting(8192, "how much of a prompt the tree looks at", ge=1)


Seconds = Annotated[float, Field(gt=0)]
class BatchConfig(_Settings):
    """OpenAI files and batch jobs (/v1/files, /v1/batches); fixed while the router runs."""

    files_dir: str | None = setting(None, "uploads and batch output files live here (batch progress: the "
                                    "state store; one shared directory for N routers); default: files/ "
                                    "beside the sqlite state (with etcd, the API is off without it)", flag="--files-dir", live=False)
    max_file_bytes: int = setting(200 * 1024 * 1024, "an upload's size limit in bytes (OpenAI's: 200 MB)",
                                  flag="--max-file-bytes", live=False, ge=1)
    concurrency: int = setting(4, "batch requests in flight at once, all batches together, in the low "
                               "priority class", live=False, ge=1)
    retry_for: Seconds = setting(300.0, "seconds a batch request the router cannot place yet (503) is retried",
                                 live=False)


class EtcdAccess(_Settings):
    """How the router reaches etcd over TLS (``--state etcds://...``) and who it is there. etcd's
    gateway answers 400 to a client certificate that names a CommonName: the user is the etcd user."""

    ca: str | None = setting(None, "CA bundle (PEM) the etcd members' certificates must chain to "
                                   "(default: the system's)", live=False)
    cert: str | None = setting(None, "client certificate (PEM) shown to etcd (--client-cert-auth); it must "
                                     "name no CommonName", live=False)
    key: str | None = setting(None, "the private key of --etcd-cert", live=False)
    user: str | None = setting(None, "the etcd user (etcd's authentication on); its password is read from "
                                     "--etcd-password-file", live=False)
    password_file: str | None = setting(None, "a file whose first line is the etcd user's password (a mounted "
                                              "Secret; never the password itself on a command line)", live=False)

    @model_validator(mode="after")
    def _pairs(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd.cert and etcd.key go together")
        if (self.user is None) != (self.password_file is None):
            raise ValueError("etcd.user and etcd.password_file go together")
        return self

    @property
    def given(self) -> bool:
        return any(getattr(self, f) is not None for f in type(self).model_fields)


class RouterConfig(_Settings):
    # listening and the edge (fixed while the router runs)
    host: str = setting("127.0.0.1", "address to listen on", live=False)
    port: int = setting(30000, "port to listen on (0: any free one)", live=False, ge=0, le=65535)
    max_request_body_bytes: int = setting(8 * 1024 * 1024, "larger request bodies get 413", live=False, ge=1)
    timeout_keep_alive: float = setting(5.0, "seconds an idle connection stays open", live=False, gt=0)
    timeout_request_header: float = setting(10.0, "seconds a request's headers may take once begun", live=False,
                                            gt=0)
    timeout_request_body: float = setting(60.0, "seconds a request body may take to arrive; then 408", live=False,
                                          gt=0)
    # routing
    policy: str = setting("fastest", f"how a replica is picked: {', '.join(POLICY_NAMES)}")
    priority_weights: dict[str, Annotated[float, Field(gt=0)]] = setting(
        help="WFQ weights per priority class, e.g. high=3,normal=1,low=1",
        default_factory=lambda: dict(DEFAULT_PRIORITY_WEIGHTS))
    health: HealthConfig = setting(default_factory=HealthConfig, alias="health_check")
    guard: GuardConfig = setting(default_factory=GuardConfig, alias="canary_guard")
    prefix: PrefixConfig = setting(default_factory=PrefixConfig)
    placement: PlacementConfig = setting(default_factory=PlacementConfig)
    breaker: BreakerConfig = setting(default_factory=BreakerConfig, alias="circuit_breaker")
    batch: BatchConfig = setting(default_factory=BatchConfig)
    max_retries: int = setting(2, "other replicas tried when one fails before the first token", ge=0)
    migration_limit: int = setting(1, "times an answer (streamed or not) whose replica fails after the first "
                                   "token goes on, spliced, on another replica (0: it ends with an error)", ge=0)
    max_inflight_per_replica: int | None = setting(
        None, "requests in flight per replica before the router queues (default: its max running)", ge=1)
    max_queue: int = setting(1024, "requests waiting in the router, all classes together, before 503", ge=0)
    queue_timeout: Seconds = setting(60.0, "longest wait in the router's queue before a 503")
    connect_timeout: Seconds = setting(5.0, "seconds to connect to a replica", live=False)
    request_timeout: Seconds = setting(600.0, "longest silence from a replica while answering", live=False)
    first_token_timeout: Seconds = setting(300.0, "arrival to a stream's first token, queueing and retries "
                                                  "included; then 504")
    total_timeout: Seconds | None = setting(None, "arrival to the last byte of an answer (default: no limit)")
    replica_priorities: dict[str, int] = setting(
        help="the replica scheduler's priority per class (lower runs first), e.g. high=-10,normal=0,low=10",
        default_factory=lambda: dict(DEFAULT_REPLICA_PRIORITIES), flag_type="int_map")
    drain_timeout: Seconds = setting(30.0, "in-flight requests get this long on SIGTERM or removal")
    api_key: str | None = setting(None, "clients must send it (not /health, /metrics)")
    replica_api_key: str | None = setting(None, "sent to the replicas", live=False)
    replica_ca_bundle: str | None = setting(None, "CA bundle (PEM) that https replicas' certificates must chain "
                                                  "to (default: the system's)", live=False)
    replica_client_cert: str | None = setting(None, "client certificate (PEM) shown to https replicas that ask "
                                                    "for one (serve --ssl-ca-certs)", live=False)
    replica_client_key: str | None = setting(None, "the private key of --replica-client-cert", live=False)
    # state (polychip/router/state): weights, rollbacks, the replica registry, the leader; and the
    # workloads' records and launched replicas' logs (state_dir)
    state: str = setting("sqlite", "the state store: sqlite (a file in --state-dir), etcd://h1:2379,h2:2379 "
                         "(N routers share it), etcds://... (TLS; --etcd-*) or memory://", live=False)
    state_dir: str | None = setting(None, "sqlite's directory (default: $POLYCHIP_STATE_DIR, else "
                                    "~/.local/state/polychip/router-PORT); also keeps workload records (relaunched "
                                    "after a restart) and the launched replicas' logs (unset: workload records in "
                                    "memory, logs in a temporary folder)", live=False)
    node_id: str | None = setting(None, "this router's name among N routers and in workload placement "
                                  "(default: HOST-PORT for the state, the hostname for workloads)", live=False)
    state_lease_ttl: float = setting(10.0, "seconds a dead router's leadership and replica registry outlive it",
                                     live=False, ge=1, le=300)
    etcd: EtcdAccess = setting(default_factory=EtcdAccess)
    workload_events: int = setting(100, "events kept per workload record (the oldest go first; the record "
                                        "counts those dropped)", live=False, ge=5, le=10_000)
    replica_log_max_bytes: int = setting(10 * 2**20, "each launched replica's log file rotates at this size",
                                         live=False, ge=1024)
    replica_log_backups: int = setting(3, "rotated log files kept per launched replica", live=False, ge=1)

    @model_validator(mode="after")
    def _client_cert_and_key(self):
        if (self.replica_client_cert is None) != (self.replica_client_key is None):
            raise ValueError("replica_client_cert and replica_client_key go together")
        return self

    @model_validator(mode="after")
    def _etcd_access(self):
        if self.etcd.given and not self.state.startswith("etcds://"):
            raise ValueError(f"the etcd settings (TLS, user) apply to --state etcds://... only (state is "
                             f"{self.state!r}): an etcd password never goes over plain HTTP")
        return self

    @field_validator("policy")
    @classmethod
    def _policy(cls, v):
        if v not in POLICY_NAMES:
            raise ValueError(f"unknown policy {v!r}; expected one of {list(POLICY_NAMES)}")
        return v

    @field_validator("priority_weights", "replica_priorities")
    @classmethod
    def _classes(cls, v, info):
        """Known classes only; the ones not given keep their defaults."""
        unknown = sorted(set(v) - set(PRIORITY_CLASSES))
        if unknown:
            raise ValueError(f"unknown priority class(es) {unknown}; expected {list(PRIORITY_CLASSES)}")
        defaults = DEFAULT_PRIORITY_WEIGHTS if info.field_name == "priority_weights" else DEFAULT_REPLICA_PRIORITIES
        return {**defaults, **v}

    @model_validator(mode="after")
    def _deadlines(self):
        if self.total_timeout is not None and self.total_timeout < self.first_token_timeout:
            raise ValueError(f"total_timeout ({self.total_timeout:g}s) must be >= first_token_timeout "
                             f"({self.first_token_timeout:g}s)")
        return self


# reload
def reload_changes(old: RouterConfig, new: RouterConfig) -> list[str]:
    """The dotted names of the settings that differ; a ConfigError naming those a reload cannot change."""
    changed, fixed = _diff(old, new, "")
    if fixed:
        raise ConfigError(f"router.{', router.'.join(fixed)} cannot change while the router runs (restart it to "
                          "change it); the reload is refused and the running set is unchanged")
    return changed


def _diff(old: _Settings, new: _Settings, prefix: str) -> tuple[list[str], list[str]]:
    changed, fixed = [], []
    for name, f in type(old).model_fields.items():
        a, b = getattr(old, name), getattr(new, name)
        if isinstance(a, _Settings):
            c, x = _diff(a, b, f"{prefix}{name}.")
            changed, fixed = changed + c, fixed + x
        elif a != b:
            changed.append(prefix + name)
            if not (f.json_schema_extra or {}).get("live", True):
                fixed.append(prefix + name)
    return changed, fixed


class LiveSettings:
    """The settings in force. Parts read ``now`` when they act; those that keep something built from a
    setting (the queue's weights, the policy, each breaker, the retry budget) rebuild it in their
    ``on_change`` hook, which a reload runs with (old, new) after the new settings are in."""

    def __init__(self, cfg: RouterConfig):
        self.now = cfg
        self._hooks: list[Callable[[RouterConfig, RouterConfig], None]] = []

    def on_change(self, hook: Callable[[RouterConfig, RouterConfig], None]) -> None:
        self._hooks.append(hook)

    def replace(self, cfg: RouterConfig) -> None:
        old, self.now = self.now, cfg
        for hook in self._hooks:
            hook(old, cfg)
