"""deploy/k8s validates offline against Kubernetes' own schemas (kubernetes-validate, strict)
and KEDA's ScaledObject schema (deploy/k8s/schemas), and its pieces agree with each other."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shared.config import Settings
from shared.redis_url import check_url, parse_sentinel_url

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes minor we promise (policy/v1, autoscaling/v2) and the newest shipped.
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
KEDA_SCHEMA = json.loads((K8S / "schemas" / "keda.sh-scaledobject-v1alpha1.json").read_text())


def _manifests() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


DOCS = _manifests()


def _validate(doc: dict, version: str) -> None:
    if doc["apiVersion"].startswith("keda.sh/"):
        jsonschema.Draft202012Validator(KEDA_SCHEMA).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_strictly(doc: dict, version: str) -> None:
    _validate(doc, version)


@pytest.mark.parametrize(
    ("kind", "break_it"),
    [
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imag="x")),
        ("Deployment", lambda d: d["spec"].update(replicas="two")),
        ("ScaledObject", lambda d: d["spec"].update(minReplicas=0)),
        ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].pop("query")),
        ("ScaledObject", lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=8)),
    ],
)
def test_the_validators_catch_mistakes(kind: str, break_it: object) -> None:
    broken = copy.deepcopy(next(iter(_by_kind(kind).values())))
    break_it(broken)  # type: ignore[operator]
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        _validate(broken, KUBE_VERSIONS[-1])


def test_api_probes_ready_and_health() -> None:
    api = _by_kind("Deployment")["ladle-api"]["spec"]["template"]["spec"]["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert api["livenessProbe"]["httpGet"]["path"] == "/health"
    assert api["command"] == ["python", "-m", "api"]


def _config() -> dict[str, str]:
    return _by_kind("ConfigMap")["ladle-config"]["data"]


def test_config_names_settings_and_the_sentinels() -> None:
    known = Settings(_env_file=None).model_dump()
    config = _config()
    assert all(name.startswith("LLM_") and name[4:].lower() in known for name in config)
    url = config["LLM_REDIS_URL"]
    check_url(url)
    target = parse_sentinel_url(url)
    sentinels = _by_kind("StatefulSet")["ladle-sentinel"]
    names = {f"ladle-sentinel-{i}.ladle-sentinel" for i in range(sentinels["spec"]["replicas"])}
    assert {host for host, _ in target.sentinels} == names
    assert {port for _, port in target.sentinels} == {26379}
    assert (
        f"monitor {target.master} "
        in _by_kind("ConfigMap")["ladle-redis-scripts"]["data"]["sentinel.sh"]
    )


def _workers() -> dict[str, dict]:
    return {n: d for n, d in _by_kind("Deployment").items() if n.startswith("ladle-worker-")}


def _env(deployment: dict) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_workers_have_resources_and_time_to_drain() -> None:
    drain_s = float(_config()["LLM_SHUTDOWN_TIMEOUT_S"])
    for name, deployment in _workers().items():
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["command"] == ["python", "-m", "worker"], name
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
        assert "memory" in container["resources"]["limits"], name
        assert pod["terminationGracePeriodSeconds"] >= drain_s + 15, name
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == _config()["LLM_WORKER_METRICS_PORT"]
        Settings(_env_file=None, **{k[4:].lower(): v for k, v in _env(deployment).items()})


def test_each_model_scales_on_its_own_queue_and_the_batch_lane_to_zero() -> None:
    scaled = _by_kind("ScaledObject")
    workers = _workers()
    assert set(scaled) == set(workers)
    prometheus = _by_kind("Service")["prometheus"]
    for name, scaled_object in scaled.items():
        spec = scaled_object["spec"]
        assert spec["scaleTargetRef"]["name"] == name
        env = _env(workers[name])
        lanes = env.get("LLM_WORKER_LANES", "interactive,batch").split(",")
        (trigger,) = spec["triggers"]
        query = trigger["metadata"]["query"]
        assert f'model="{env["LLM_SERVED_MODEL_NAME"]}"' in query
        assert f'lane="{lanes[0]}"' in query and "llm_lane_queue_depth" in query
        assert trigger["metadata"]["serverAddress"].startswith(
            f"http://{prometheus['metadata']['name']}.ladle.svc:"
        )
        # Only a batch-only group may reach zero: /ready needs a worker of each model.
        assert (spec["minReplicaCount"] == 0) == (lanes == ["batch"]), name
    assert any(s["spec"]["minReplicaCount"] == 0 for s in scaled.values())


def test_prometheus_scrapes_annotated_pods() -> None:
    config = yaml.safe_load(_by_kind("ConfigMap")["prometheus-config"]["data"]["prometheus.yml"])
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    keep = job["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    scraped = [
        d
        for d in DOCS
        if d["kind"] == "Deployment"
        and d["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape")
    ]
    assert {d["metadata"]["name"] for d in scraped} == {"ladle-api", *_workers()}
