"""bench/gpu_swap.py, the GPU check's host-tier section, run on the CPU so it cannot rot."""

from __future__ import annotations

import json

from bench import gpu_swap


def test_the_host_tier_check_passes_and_swaps(capsys) -> None:
    assert gpu_swap.main(["--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["swap"]["swapped_out_blocks"] > 0, result
    assert result["recompute"]["batched_tokens"] > result["swap"]["batched_tokens"], result
