"""Deployment files: YAML validated with pydantic (strict), then checked as a whole.

Every error names the file, the field path and what was expected, in one DeploymentError.
Device checks (does the device exist, is tp within what is there, does the device have the
model's dtype) are in ``placement``; this module knows only the file's shape and its own
cross-references. The ``router:`` section is the router's settings model itself.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from polychip.config import QUANTIZATIONS, TRANSFER_BACKENDS
from polychip.errors import ConfigError
from polychip.http.serve_settings import parse_serve_args
from polychip.router.settings import RouterConfig, SloTargets
from polychip.trust.options import RouterTrust
from polychip.router.workload_spec import WorkloadSpec
from polychip.yaml_file import read_yaml_file


class DeploymentError(ConfigError):
    """A deployment file is missing, malformed or inconsistent."""


Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Weight = Annotated[float, Field(ge=0)]


def _known_quantization(v: str | None) -> str | None:
    if v is not None and v not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {v!r}; expected one of {list(QUANTIZATIONS)} or null")
    return v


Quantization = Annotated[str | None, AfterValidator(_known_quantization)]
DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]*(:[0-9]+)?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ReplicaEntry(_Strict):
    name: Name
    model: str = Field(min_length=1)             # the served name (one of models[].name)
    version: Name = "default"                    # version label it serves
    device: str | None = None                    # cpu, cuda:0, simxpu:1 (launched replicas)
    url: str | None = None                       # a replica run elsewhere: not launched, only checked
    model_path: str | None = None                # None: the embedded default model
    dtype: str = "auto"
    quantization: Quantization = None
    tp_size: int = Field(default=1, ge=1)
    pp_devices: list[str] = Field(default_factory=list)     # a pipeline group: each stage's device, device first
    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=1, le=65535)   # None: a free port
    device_config: str | None = None             # device spec YAML for the replica
    args: list[str] = Field(default_factory=list)            # more `polychip serve` flags (checked as its settings)
    env: dict[str, str] = Field(default_factory=dict)
    # a side of a prefill/decode pair (docs/disaggregation.md): launched with --disaggregation-mode ROLE
    role: Literal["prefill", "decode"] | None = None
    transfer_backend: str = "tcp"                # --disaggregation-transfer-backend of a launched side
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)   # a prefill side's; None: a free one

    @field_validator("transfer_backend")
    @classmethod
    def _backend(cls, v):
        if v not in TRANSFER_BACKENDS:
            raise ValueError(f"expected one of {list(TRANSFER_BACKENDS)}, got {v!r}")
        return v

    @field_validator("args")
    @classmethod
    def _serve_args(cls, v):
        parse_serve_args(v)
        return v

    @field_validator("device")
    @classmethod
    def _device_shape(cls, v):
        if v is not None and not DEVICE_RE.match(v):
            raise ValueError(f"expected a device like cpu, cuda:0 or simxpu:1, got {v!r}")
        return v

    @field_validator("pp_devices")
    @classmethod
    def _stage_devices(cls, v):
        bad = [d for d in v if not DEVICE_RE.match(d)]
        if bad or len(v) == 1 or len(set(v)) != len(v):
            raise ValueError(f"expected two or more distinct devices like cpu:0 or simxpu:1, one per pipeline stage, "
                             f"got {v!r}")
        return v

    @field_validator("url")
    @classmethod
    def _url_shape(cls, v):
        if v is not None and not re.match(r"^https?://[^/\s]+/?$", v):
            raise ValueError(f"expected http://host:port, got {v!r}")
        return v.rstrip("/") if v else v

    @model_validator(mode="after")
    def _launched_or_remote(self):
        if (self.device is None) == (self.url is None):
            raise ValueError("give device (a replica the router launches) or url (one run elsewhere), "
                             "exactly one of them")
        if self.url is not None and (self.port is not None or self.args or self.model_path or self.role):
            raise ValueError("a url replica is run elsewhere; port, args, model_path and role belong to launched "
                             "ones (a url replica reports its role itself)")
        if self.pp_devices and (self.device != self.pp_devices[0] or self.tp_size > 1 or self.role):
            raise ValueError("a pipeline group (pp_devices) names its stage 0 device as device, and takes neither "
                             "tp_size nor role")
        if self.bootstrap_port is not None and self.role != "prefill":
            raise ValueError("bootstrap_port belongs to a replica with role prefill")
        return self


class ModelEntry(_Strict):
    name: str = Field(min_length=1)
    versions: dict[Name, Weight] = Field(min_length=1)   # version label -> traffic weight
    baseline: Name | None = None                         # default: the first version
    preferred_device_types: list[str] = Field(default_factory=list)
    dtype: str | None = None                             # what the model needs of a device
    quantization: Quantization = None
    slo: SloTargets | None = None                        # its requests' default latency targets

    @model_validator(mode="after")
    def _weights(self):
        if sum(self.versions.values()) <= 0:
            raise ValueError(f"versions: the weights {dict(self.versions)} sum to 0; expected a positive sum")
        if self.baseline is not None and self.baseline not in self.versions:
            raise ValueError(f"baseline: {self.baseline!r} is not one of the versions {list(self.versions)}")
        return self

    @property
    def baseline_version(self) -> str:
        return self.baseline or next(iter(self.versions))


class DeclaredWorkload(WorkloadSpec):
    """A workload the file declares; ``id`` names it (the router keeps it running, a reload
    restarts it when its fields change and stops it when the file drops it)."""

    id: Name

    def spec(self) -> WorkloadSpec:
        return WorkloadSpec(**self.model_dump(exclude={"id"}))


class Deployment(_Strict):
    replicas: list[ReplicaEntry] = Field(default_factory=list)
    models: list[ModelEntry] = Field(default_factory=list)
    workloads: list[DeclaredWorkload] = Field(default_factory=list)   # router/workloads.py
    router: RouterConfig = Field(default_factory=RouterConfig)      # the router's settings (router/settings.py)
    source: str = Field(default="<inline>", exclude=True)

    @model_validator(mode="after")
    def _cross_references(self):
        problems = []
        if not self.replicas and not self.workloads:
            problems.append("replicas: declare at least one replica or workload")
        elif self.replicas and not self.models:
            problems.append("models: declare the models the replicas serve")
        ids = [w.id for w in self.workloads]
        problems += [f"workloads: duplicate id {i!r}" for i in sorted({i for i in ids if ids.count(i) > 1})]
        models = {}
        for i, m in enumerate(self.models):
            if m.name in models:
                problems.append(f"models.{i}.name: duplicate model {m.name!r} (also models.{models[m.name]})")
            models.setdefault(m.name, i)
        names, ports = {}, {}
        for i, r in enumerate(self.replicas):
            if r.name in names:
                problems.append(f"replicas.{i}.name: duplicate name {r.name!r} (also replicas.{names[r.name]})")
            names.setdefault(r.name, i)
            if r.port is not None:
                key = (r.host, r.port)
                if key in ports:
                    problems.append(f"replicas.{i}.port: duplicate port {r.port} on {r.host} "
                                    f"(also replicas.{ports[key]})")
                ports.setdefault(key, i)
            m = models.get(r.model)
            if m is None:
                problems.append(f"replicas.{i}.model: unknown model {r.model!r}; expected one of "
                                f"{sorted(models)} (the models section)")
            elif r.version not in self.models[m].versions:
                problems.append(f"replicas.{i}.version: model {r.model!r} has no version {r.version!r}; "
                                f"expected one of {list(self.models[m].versions)}")
        for i, m in enumerate(self.models):
            for v, w in m.versions.items():
                if w > 0 and not any(r.model == m.name and r.version == v for r in self.replicas):
                    problems.append(f"models.{i}.versions.{v}: weight {w:g} but no replica serves version {v!r}")
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _lines(err: ValidationError, source: str) -> list[str]:
    out = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] != "value_error" and not isinstance(e.get("input"), (dict, list)):
            msg = f"{msg}; got {e.get('input')!r}"
        for part in msg.split("\n"):
            m = re.match(r"^([a-z_]+(?:\.[\w-]+)*): (.*)$", part)
            if e["type"] == "value_error" and m:
                path = ".".join(filter(None, (where, m.group(1))))
                out.append(f"{source}: {path}: {m.group(2)}")
            else:
                out.append(f"{source}: {where or '<top level>'}: {part}")
    return out


def raise_problems(source: str, lines: list[str]) -> None:
    if lines:
        uniq = list(dict.fromkeys(lines))
        raise DeploymentError(uniq[0] if len(uniq) == 1 else f"{source}: {len(uniq)} problems\n  " +
                              "\n  ".join(uniq))


def from_dict(data: Any, source: str = "<inline>") -> Deployment:
    if not isinstance(data, dict):
        raise DeploymentError(f"{source}: expected a mapping with replicas, models and router at the top level, "
                              f"got {type(data).__name__}")
    if "source" in data:
        raise DeploymentError(f"{source}: source: unknown key")
    try:
        return Deployment.model_validate({**data, "source": source})
    except ValidationError as e:
        raise_problems(source, _lines(e, source))
        raise


def load_deployment(path: str, trust=None) -> Deployment:
    """The deployment file at ``path``; with ``trust`` (TrustOptions), its detached signature is
    checked against the site trust store first (polychip sign); with the router's (RouterTrust),
    a guarded serve setting its replicas or workloads give and the router does not allow is refused."""
    if trust is not None:
        from polychip.trust.detached import verify_file
        verify_file(path, trust.store(), trust.allow_unsigned, "deployment file")
    data = read_yaml_file(path, "deployment", "replicas, models and router", DeploymentError)
    dep = from_dict(data, path)
    if isinstance(trust, RouterTrust):
        raise_problems(path, [f"{path}: {line}" for line in guarded_refusals(dep, trust)])
    return dep


def guarded_refusals(dep: Deployment, trust) -> list[str]:
    """The guarded serve settings (``polychip.trust.options.GUARDED``) that the deployment's
    launched replicas and workloads give and the router's trust settings do not allow."""
    out = []
    for i, r in enumerate(dep.replicas):
        out += trust.refusals(parse_serve_args(r.args), f"replicas.{i}.args")
    for i, w in enumerate(dep.workloads):
        out += trust.refusals(w.serve_options(), f"workloads.{i}.serve_args")
    return out
