"""deploy/compose.yaml: valid against the Compose Specification's schema (kept in the repo),
and every kvgate container's command accepted by that process's own parser."""

from __future__ import annotations

import json
import re
from urllib.parse import urlparse

import jsonschema
import yaml

from executor.kv_sender import MAX_PARALLEL_PUSHES
from tests.helpers import REPO
from tests.unit.deploy_args import check_container, image_env, listened_ports

DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
SCHEMA = DEPLOY / "schemas" / "compose-spec.json"


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # YAML merge keys (<<) resolved


def kvgate_services() -> dict[str, dict]:
    """The services built from the project's Dockerfile, by name."""
    return {
        name: service
        for name, service in compose()["services"].items()
        if service.get("build", {}).get("dockerfile") == "deploy/docker/Dockerfile"
    }


def duration_s(text: str) -> float:
    """A compose duration such as `2m` or `90s`, in seconds."""
    match = re.fullmatch(r"(\d+)([hms])", text)
    assert match, f"{text!r}: expected a number and h, m or s"
    return int(match.group(1)) * {"h": 3600, "m": 60, "s": 1}[match.group(2)]


def bind_mounts(service: dict) -> dict[str, str]:
    """Host path (relative to deploy/) of each bind mount, by container path."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = source
    return mounts


def test_the_file_is_valid_against_the_compose_specification() -> None:
    schema = json.loads(SCHEMA.read_text())
    assert schema["$schema"].startswith("http://json-schema.org/draft/2019-09/schema")
    jsonschema.Draft201909Validator.check_schema(schema)
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(compose())]
    assert not errors, errors


def test_it_runs_redis_with_an_append_only_file_and_each_process_twice() -> None:
    services = compose()["services"]
    redis = services["redis"]["command"]
    assert redis[redis.index("--appendonly") + 1] == "yes", redis
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"]), "no Redis volume"
    roles = [service["command"][0] for service in kvgate_services().values()]
    assert sorted(roles) == ["executor"] * 2 + ["gateway"] * 2 + ["scheduler"] * 2, roles
    assert {"prometheus", "grafana"} <= services.keys()


def service_config(name: str, service: dict) -> object:
    """The validated config of the process a kvgate service runs."""
    env = image_env() | {k: str(v) for k, v in service["environment"].items()}
    return check_container(service["command"], env, f"compose service {name}")


def test_every_kvgate_service_runs_a_process_that_accepts_its_command() -> None:
    services = compose()["services"]
    for name, service in kvgate_services().items():
        config = service_config(name, service)
        assert urlparse(config.redis_url).hostname in services, f"{name}: {config.redis_url}"
        if service["command"][0] == "gateway":
            assert config.advertise_host == name, f"{name} must advertise its service name"
        if service["command"][0] == "executor":
            assert config.executor_id == name, f"{name}: executor id {config.executor_id}"
            assert config.kv_transfer_port > 0, f"{name}: peers need a fixed KvTransfer port"
            assert config.kv_transfer_advertise_host == name, f"{name}: peers dial its name"
            # The running requests' KV moves in rounds of MAX_PARALLEL_PUSHES, each at most
            # one --kv-transfer-timeout-s: all of them are handed on before the stop's kill.
            rounds = -(-config.engine.max_num_seqs // MAX_PARALLEL_PUSHES)
            grace_s = duration_s(service["stop_grace_period"])
            assert grace_s >= rounds * config.kv_transfer_timeout_s, f"{name}: {grace_s} s"


def test_gateways_publish_their_grpc_and_http_ports_and_nothing_unlistened() -> None:
    host_ports: list[str] = []
    for name, service in kvgate_services().items():
        config = service_config(name, service)
        mappings = [mapping.split(":") for mapping in service.get("ports", [])]
        host_ports += [host for host, _ in mappings]
        published = {int(container) for _, container in mappings}
        assert published <= listened_ports(config), f"{name} publishes {published}"
        if service["command"][0] == "gateway":
            assert {config.port, config.http_port} <= published, f"{name}: {published}"
    assert len(host_ports) == len(set(host_ports)), f"a host port twice: {host_ports}"


def test_prometheus_scrapes_every_kvgate_service_by_name() -> None:
    prometheus = compose()["services"]["prometheus"]
    mounts = bind_mounts(prometheus)
    config_path = DEPLOY / mounts["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    jobs = config["scrape_configs"]
    targets = {t for job in jobs for static in job["static_configs"] for t in static["targets"]}
    port = image_env()["KVGATE_GATEWAY_METRICS_PORT"]
    assert targets == {f"{name}:{port}" for name in kvgate_services()}, targets
    for rules in config["rule_files"]:
        assert f"/etc/prometheus/{rules}" in mounts, f"{rules} is not mounted beside the config"
    for source in mounts.values():
        assert (DEPLOY / source).exists(), f"prometheus mounts {source}, which is not in deploy/"


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard() -> None:
    services = compose()["services"]
    mounts = bind_mounts(services["grafana"])
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    url = urlparse(datasource["url"])
    assert (
        url.hostname == "prometheus" and f"{url.port}:{url.port}" in services["prometheus"]["ports"]
    )
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvgate.yml").read_text())[
        "providers"
    ]
    dashboards = [t for t in mounts if t.startswith(provider["options"]["path"] + "/")]
    assert dashboards, f"nothing is mounted in {provider['options']['path']}"
    for target in dashboards:
        dashboard = json.loads((DEPLOY / mounts[target]).read_text())
        assert dashboard["uid"] and dashboard["panels"]
