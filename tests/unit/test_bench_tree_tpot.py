"""bench.tree_tpot: one-stream TPOT of another checkout's code beside this one's, in one run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import cpu_speed, tree_tpot
from tests.helpers import STORIES_260K

# A checkout whose Engine takes STEP_S per step, with SamplingParams where trees before
# common/sampling_params.py kept it: what tree_tpot measures there is that code, not this one.
STEP_S = 0.25
OLD_TREE = {
    "executor/__init__.py": "",
    "executor/config.py": """
from dataclasses import dataclass

@dataclass
class EngineConfig:
    model: str
    device: str
    kv_cache_gib: float
""",
    "engine/sampler.py": """
from dataclasses import dataclass

@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float
    ignore_eos: bool
""",
    "engine/engine.py": f"""
import time

class Engine:
    def __init__(self, config):
        self.left = 0

    def add_request(self, request_id, prompt, params):
        self.left = params.max_tokens

    def has_unfinished(self):
        return self.left > 0

    def step(self):
        time.sleep({STEP_S})
        self.left -= 1
""",
}


def old_checkout(folder: Path) -> str:
    """OLD_TREE committed in a git repository at `folder`; its commit."""
    for name, text in OLD_TREE.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)

    def git(*args: str) -> str:
        command = ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args]
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "old")
    return git("rev-parse", "HEAD")


def test_the_baseline_tree_runs_its_own_code_alternating_with_this_trees(tmp_path):
    commit = old_checkout(tmp_path)
    result = tree_tpot.interleaved(str(tmp_path), str(STORIES_260K), rounds=1, requests=2,
                                   tokens=3, runs=("float32 before", "int4"))  # fmt: skip
    assert result["baseline_commit"] == commit
    assert result["commit"].startswith(tree_tpot.commit_of(tree_tpot.THIS_TREE)[:40])
    assert set(result["tpot_ms"]) == {"float32 before", "int4"}
    assert result["best_tpot_ms"]["float32 before"] >= 1000 * STEP_S, "the old tree's Engine ran"
    assert all(ms > 0 for ms in result["best_tpot_ms"].values())
    ratios = result["over_float32_before"]
    assert ratios["int4"] == pytest.approx(
        result["best_tpot_ms"]["float32 before"] / result["best_tpot_ms"]["int4"]
    )


def test_the_baseline_ratios_become_the_one_stream_targets():
    same_run = {"tokens_per_s": {"float32 before": 20.0, "float32": 40.0, "int8": 70.0,
                                 "int4": 90.0}}  # fmt: skip
    variant = {"tokens_per_s": {1: 1.0}, "fraction_of_bandwidth_limit": 0.5}
    decode = {"variants": dict.fromkeys(("float32", "int8", "int4"), variant), "resident_bytes": {}}
    kvgate = ("kvgate float32", "kvgate bfloat16", "kvgate int8")
    rates = dict.fromkeys((*kvgate, "transformers bfloat16 generate_batch"), 1.0)
    dtypes = {"tokens_per_s": rates, "roofline_tokens_per_s": {"bfloat16": 1.0}}
    rows = cpu_speed.targets(decode, dtypes, None, same_run)
    assert rows["int8 one stream / float32 one stream"]["measured"] == 3.5
    assert rows["int4 one stream / float32 one stream"] == {"measured": 4.5, "target": 5.0,
                                                            "met": False}  # fmt: skip


def test_a_folder_that_is_no_checkout_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--baseline-tree .* holds no engine/engine.py"):
        tree_tpot.interleaved(str(tmp_path), str(STORIES_260K))
