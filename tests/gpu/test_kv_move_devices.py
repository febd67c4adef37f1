"""KV moved between engines on a GPU (engine/kv_move.py): a CUDA engine's blocks leave through
a pinned host buffer and land in another CUDA engine's cache, and greedy output after the move
equals an undisturbed run's. On the CPU too, so that it cannot rot; bench/gpu_check.sh runs the
tests/gpu folder on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.kv_move import (
    engine_layout,
    read_moved,
    release_moved,
    take_blocks,
    take_sequences,
    write_taken,
)
from tests.helpers import greedy, make_engine, run_to_completion

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]
GREEDY = greedy(32)
PROMPT = [1, 403, 178, 261, 144, 230, 160, 297, 261, 125, 29, 450, 178, 471] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_a_request_moved_mid_generation_finishes_as_an_undisturbed_run(device: str) -> None:
    undisturbed, sender, receiver = (make_engine(device=device) for _ in range(3))
    undisturbed.add_request("r", PROMPT, GREEDY)
    expected = run_to_completion(undisturbed)["r"]
    sender.add_request("r", PROMPT, GREEDY)
    produced: list[int] = []
    while len(produced) < 10:
        for output in sender.step():
            produced.extend(output.new_token_ids)
    [moved] = take_sequences(sender)
    block_ids = take_blocks(receiver, engine_layout(sender), len(moved.token_ids))
    write_taken(receiver, block_ids, read_moved(sender, moved, 0, len(moved.block_ids)))
    receiver.kv_cache.adopt(block_ids, moved.token_ids, None, None)
    release_moved(sender, moved)
    receiver.add_request("r", PROMPT, GREEDY, resume_token_ids=produced)
    rest = run_to_completion(receiver)["r"]
    assert produced + rest == expected
