"""examples/k8s/ against the Kubernetes API's own schemas (kubernetes-validate, offline, strict: an
unknown field fails). A LeaderWorkerSet is a CRD the package has no schema for: its leader and
worker pod templates are validated as core/v1 PodTemplateSpec (inside a PodTemplate), and its own fields are checked here.
Also: the router's flags in the Deployment are ones `polychip router` accepts, and the deployment
file in the ConfigMap loads. No cluster runs any of it here."""
import glob
import os

import kubernetes_validate
import pytest
import yaml

from polychip.commands.router import build_parser
from polychip.router.deployment import from_dict
from polychip.router.settings_flags import settings_from_args

pytestmark = pytest.mark.device_independent
K8S = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "k8s")
VERSION = "1.33"


def resources():
    out = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        with open(path) as f:
            out += [(os.path.basename(path), doc) for doc in yaml.safe_load_all(f) if doc]
    return out


def _template(spec: dict) -> dict:
    """A core/v1 PodTemplate whose ``template`` (a PodTemplateSpec) is the LWS pod template."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "lws-template"}, "template": spec}


def test_every_manifest_validates_against_the_kubernetes_schemas():
    kinds = set()
    for name, doc in resources():
        kinds.add(doc["kind"])
        if doc["kind"] == "LeaderWorkerSet":
            lws = doc["spec"]["leaderWorkerTemplate"]
            assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["size"] >= 2
            for key in ("leaderTemplate", "workerTemplate"):
                kubernetes_validate.validate(_template(lws[key]), VERSION, strict=True)
            continue
        kubernetes_validate.validate(doc, VERSION, strict=True)
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "LeaderWorkerSet"} <= kinds


def test_a_wrong_field_is_caught():
    """The check can fail: a misspelt field in a real manifest is refused."""
    name, dep = next((n, d) for n, d in resources() if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, VERSION, strict=True)


def test_replicas_request_their_chip_through_the_device_plugin():
    asked = set()
    for name, doc in resources():
        if doc["kind"] == "LeaderWorkerSet":
            lws = doc["spec"]["leaderWorkerTemplate"]
            pods = [lws["leaderTemplate"], lws["workerTemplate"]]
        elif doc["kind"] == "StatefulSet" and doc["metadata"]["name"].startswith("replica-"):
            pods = [doc["spec"]["template"]]
        else:
            continue
        for pod in pods:
            for c in pod["spec"]["containers"]:
                asked |= set(c["resources"]["limits"]) - {"memory", "cpu"}
    assert {"nvidia.com/gpu", "huawei.com/Ascend910"} <= asked


def test_router_args_parse_and_its_deployment_file_loads():
    router = next(d for _, d in resources() if d["kind"] == "Deployment" and d["metadata"]["name"] == "polychip-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "router"
    cfg = settings_from_args(build_parser().parse_args(args[1:]))
    assert cfg.state.startswith("etcds://") and cfg.state.count(",") == 2 and cfg.port == 30000
    # etcd over TLS as its user: certificates and the password file mounted read-only from Secrets,
    # the password itself nowhere in the manifest
    pod = router["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    for path in (cfg.etcd.ca, cfg.etcd.cert, cfg.etcd.key, cfg.etcd.password_file):
        mount = next(m for p, m in mounts.items() if path.startswith(p + "/"))
        assert mount["readOnly"] and mount["name"] in secrets, path
    assert cfg.etcd.user == "polychip" and not any("password=" in a for a in args)
    etcd = next(d for _, d in resources() if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "etcd")
    command = " ".join(etcd["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--client-cert-auth" in command and "--listen-client-urls https://" in command
    cm = next(d for _, d in resources() if d["kind"] == "ConfigMap")
    dep = from_dict(yaml.safe_load(cm["data"]["deployment.yaml"]), "k8s ConfigMap")
    assert {r.name for r in dep.replicas} == {"gpu-0", "gpu-1", "npu-0", "tp2-0"}
