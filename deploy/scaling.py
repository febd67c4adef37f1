"""The executors' scaling rule, read from deploy/k8s (KEDA's ScaledObject), and a local
Prometheus that evaluates its query against a local stack.

KEDA's Prometheus trigger feeds the query's value to a HorizontalPodAutoscaler as an average
per replica, so the replicas wanted are ceil(value / threshold), kept within min and max;
`ScalingRule.desired_replicas` is that arithmetic. The scaling-signal test and
deploy/scaler_sim.py use this module, so they read the very query and numbers a cluster uses.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from deploy.stack import ROOT, free_port, wait_until

EXECUTOR_MANIFEST = ROOT / "deploy" / "k8s" / "base" / "executor.yaml"
ALERT_RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"


@dataclass(frozen=True, slots=True)
class ScalingRule:
    """What the ScaledObject says: the signal, its per-executor target, and the bounds."""

    query: str  # PromQL: requests queued, waiting on an executor, or running
    threshold: float  # target value of the query per executor
    min_replicas: int
    max_replicas: int
    polling_interval_s: float  # how often KEDA reads the query
    scale_down_window_s: float  # the HPA's scale-down stabilization window
    scale_down_period_s: float  # at most one executor drained per this period

    @classmethod
    def from_manifest(cls, path: Path = EXECUTOR_MANIFEST) -> ScalingRule:
        """Returns: the rule of the ScaledObject in `path` (a multi-document YAML file)."""
        (scaled,) = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "ScaledObject"]
        spec = scaled["spec"]
        (trigger,) = spec["triggers"]
        scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        (policy,) = scale_down["policies"]
        return cls(
            query=" ".join(trigger["metadata"]["query"].split()),
            threshold=float(trigger["metadata"]["threshold"]),
            min_replicas=spec["minReplicaCount"],
            max_replicas=spec["maxReplicaCount"],
            polling_interval_s=float(spec["pollingInterval"]),
            scale_down_window_s=float(scale_down["stabilizationWindowSeconds"]),
            scale_down_period_s=float(policy["periodSeconds"]),
        )

    def desired_replicas(self, value: float) -> int:
        """The executors the autoscaler asks for when the query reads `value`."""
        wanted = math.ceil(value / self.threshold) if value > 0 else 0
        return max(self.min_replicas, min(self.max_replicas, wanted))


class LocalPrometheus:
    """A real `prometheus` on a free loopback port, scraping the /metrics ports it is given
    (re-read from a file, so targets can change while it runs) every `scrape_interval_s`."""

    def __init__(self, work_dir: Path, scrape_interval_s: float = 1.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus not found: `make setup` installs it (Debian package)")
        work_dir.mkdir(parents=True, exist_ok=True)
        self._targets_file = work_dir / "targets.json"
        self.set_targets({})
        config = {
            "global": {
                "scrape_interval": f"{scrape_interval_s:g}s",
                "evaluation_interval": f"{scrape_interval_s:g}s",
            },
            "rule_files": [str(ALERT_RULES)],
            "scrape_configs": [
                {
                    "job_name": "kvgate",
                    "file_sd_configs": [
                        {"files": [str(self._targets_file)], "refresh_interval": "1s"}
                    ],
                }
            ],
        }
        config_file = work_dir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        argv = [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
        ]
        with open(work_dir / "prometheus.log", "ab") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._ready, 30.0, "prometheus", self._proc)

    def set_targets(self, metrics_ports: dict[str, int]) -> None:
        """Scrape exactly these /metrics ports on 127.0.0.1 (labelled by process name)."""
        groups = [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"process": name}}
            for name, port in sorted(metrics_ports.items())
        ]
        scratch = self._targets_file.with_suffix(".tmp")
        scratch.write_text(json.dumps(groups))
        scratch.replace(self._targets_file)  # whole, never half-written

    def query(self, promql: str) -> float | None:
        """The value of an instant query with one sample; None when it has none."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as reply:
            result = json.load(reply)["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def healthy_targets(self) -> int:
        """How many targets the last scrape reached."""
        return int(self.query("sum(up)") or 0)

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False
