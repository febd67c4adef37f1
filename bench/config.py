"""The configuration of one `kvgate bench` run (bench/cli.py fills it from the flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.workloads import WorkloadConfig
from client.api import Credentials
from common.config import check_host_port
from deploy.models import ROOT, choose_model

DEFAULT_OUT = Path("bench/results/bench.json")
DEFAULT_LOG_DIR = ROOT / ".run" / "bench-logs"
# The policies --sweep-policy compares: both the scheduler and the executor know them.
SWEPT_POLICIES = ("fcfs", "lpm")


@dataclass(slots=True)
class BenchConfig:
    """The flags of one `kvgate bench`; validated in `__post_init__`."""

    target: str
    workload: WorkloadConfig
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1: Poisson
    max_concurrency: int | None = None  # None: no limit
    slos_ms: dict[str, float] = field(default_factory=dict)
    out: Path = DEFAULT_OUT
    sweep_rates: list[float] = field(default_factory=list)
    sweep_windows_ms: list[float] = field(default_factory=list)
    sweep_policies: list[str] = field(default_factory=list)  # fcfs | lpm, one run each
    executor_flags: list[str] = field(default_factory=list)  # the sweeps' local executor's
    model: str = ""  # the served model's folder (--sweep-window, --sweep-policy, --compare-hf)
    prompt_words: str = "english"  # english | vocab (the words of --model's tokenizer)
    compare_hf: bool = False
    hf_sample: int = 4
    progress: bool = True
    log_dir: Path = DEFAULT_LOG_DIR  # where the sweeps' local stack logs
    credentials: Credentials = field(default_factory=Credentials)  # --api-key, --tls*

    def __post_init__(self) -> None:
        check_host_port("--target", self.target)
        for rate in [self.request_rate, *self.sweep_rates]:
            if not rate > 0:
                raise ValueError(f"--request-rate and --sweep-rates must be > 0 or inf, got {rate}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"--burstiness must be a finite number > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not all(math.isfinite(window) and window >= 0 for window in self.sweep_windows_ms):
            raise ValueError(
                f"--sweep-window values must be finite and >= 0 ms, got {self.sweep_windows_ms}"
            )
        bad = [p for p in self.sweep_policies if p not in SWEPT_POLICIES]
        if bad:
            raise ValueError(f"--sweep-policy values must be fcfs or lpm, got {bad[0]!r}")
        sweeps = [self.sweep_rates, self.sweep_windows_ms, self.sweep_policies]
        if sum(bool(sweep) for sweep in sweeps) > 1:
            raise ValueError(
                "--sweep-rates, --sweep-window and --sweep-policy cannot be combined: pick one"
            )
        if self.compare_hf and any(sweeps):
            raise ValueError(
                "--compare-hf compares one run: leave out --sweep-rates/--sweep-window/"
                "--sweep-policy"
            )
        if self.compare_hf and self.workload.workload == "chat":
            raise ValueError("--compare-hf runs Generate workloads: use random or shared-prefix")
        if self.hf_sample < 1:
            raise ValueError(f"--hf-sample must be >= 1, got {self.hf_sample}")

    def plot_path(self, kind: str) -> Path:
        """Returns: OUT_kind.png next to the results JSON."""
        return self.out.with_name(f"{self.out.stem}_{kind}.png")


def served_model(config: BenchConfig) -> str:
    """--model, else the folder `make run` serves (KVGATE_MODEL, stories260K, ...)."""
    return config.model or str(choose_model())
