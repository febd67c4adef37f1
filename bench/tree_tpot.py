"""One-stream decode TPOT of a checkout's own code, beside this checkout's, in one run.

    python bench/tree_tpot.py TREE MODEL [QUANTIZATION]   # one measure, one JSON line

Run by path, the script puts TREE first on sys.path, so it measures that checkout's Engine:
e.g. the code before a change, checked out with `git worktree add --detach /tmp/k COMMIT`.
It uses only the Engine API every version with the CPU kernels has (EngineConfig's model,
device, kv_cache_gib and, when given, quantization; add_request, step, has_unfinished).

`interleaved` (bench.cpu_speed --baseline-tree) alternates such processes: the other tree's
float32 and this tree's float32, int8 and int4, one fresh process each, round after round, so
slow spells of a shared machine fall on all of them alike; each figure is its best round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

THIS_TREE = Path(__file__).resolve().parents[1]
# name -> (whose tree, quantization): the other tree's float32 first in each round.
RUNS = {
    "float32 before": ("baseline", "none"),
    "float32": ("this", "none"),
    "int8": ("this", "int8"),
    "int4": ("this", "int4"),
}


def measure(tree: str, model: str, quantization: str, requests: int = 4, tokens: int = 64) -> dict:
    """TPOT (ms) of one stream: `requests` requests one after another, 128 prompt tokens and
    `tokens` output tokens each; a request's median step (its first, the prefill, left out),
    the best request but the first (warm-up)."""
    sys.path.insert(0, tree)
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine

    try:
        from common.sampling_params import SamplingParams
    except ImportError:  # checkouts before SamplingParams moved to common/
        from engine.sampler import SamplingParams

    extra = {} if quantization == "none" else {"quantization": quantization}
    engine = Engine(EngineConfig(model=model, device="cpu", kv_cache_gib=0.5, **extra))
    gen = torch.Generator().manual_seed(0)
    medians = []
    for r in range(requests):
        prompt = torch.randint(3, 256, (128,), generator=gen).tolist()  # ids every vocabulary has
        params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{r}", prompt, params)
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times[1:]))
    return {"tpot_ms": 1000 * min(medians[1:] or medians), "threads": torch.get_num_threads()}


def tpot_ms(tree: Path, model: str, quantization: str, requests: int, tokens: int) -> float:
    """`measure` in a fresh process of this Python, on `tree`'s code."""
    command = [sys.executable, str(Path(__file__).resolve()), str(tree), model, quantization,
               str(requests), str(tokens)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"measuring {quantization} one-stream TPOT on {tree} failed:\n{done.stderr[-2000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])["tpot_ms"]


def commit_of(tree: Path) -> str:
    """The commit checked out in `tree` (with '+changes' when it has uncommitted ones)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    try:
        head = git("rev-parse", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError) as err:
        raise ValueError(f"--baseline-tree {tree} is not a git checkout: {err}") from err


def interleaved(
    baseline_tree: str,
    model: str,
    rounds: int = 3,
    requests: int = 4,
    tokens: int = 64,
    runs: tuple[str, ...] = tuple(RUNS),
) -> dict:
    """The `runs` (names in RUNS, "float32 before" among them), alternated for `rounds` rounds;
    each one's TPOTs, best, tokens/s, and tokens/s over the baseline tree's float32."""
    tree = Path(baseline_tree).resolve()
    if not (tree / "executor" / "engine.py").is_file():
        raise ValueError(f"--baseline-tree {baseline_tree} holds no engine/engine.py")
    trees = {"baseline": tree, "this": THIS_TREE}
    tpots: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name in runs:
            whose, quantization = RUNS[name]
            tpots[name].append(tpot_ms(trees[whose], model, quantization, requests, tokens))
    best = {name: min(values) for name, values in tpots.items()}
    return {
        "baseline_tree": str(tree),
        "baseline_commit": commit_of(tree),
        "commit": commit_of(THIS_TREE),
        "rounds": rounds,
        "load_average_at_end": os.getloadavg(),
        "tpot_ms": tpots,
        "best_tpot_ms": best,
        "tokens_per_s": {name: 1000 / ms for name, ms in best.items()},
        "over_float32_before": {name: best["float32 before"] / ms for name, ms in best.items()},
    }


if __name__ == "__main__":
    del sys.path[0]  # this script's folder: only TREE's modules are to be found first
    tree_arg, model_arg, quantization_arg = sys.argv[1], sys.argv[2], sys.argv[3]
    counts = [int(a) for a in sys.argv[4:6]]
    print(json.dumps(measure(tree_arg, model_arg, quantization_arg, *counts)))
