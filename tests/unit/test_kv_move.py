"""KV moved between two engines (engine/kv_move.py): the bytes, the layouts, and what the
receiver does with them; greedy output after a move equals an undisturbed run's."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.engine import Engine
from engine.kv_move import (
    KVLayout,
    KVRefused,
    engine_layout,
    idle_sessions,
    read_blocks,
    read_moved,
    release_moved,
    take_blocks,
    take_sequences,
    write_blocks,
    write_taken,
)
from tests.helpers import STORIES_260K, greedy, make_engine, run_to_completion

GREEDY = greedy(24)
PROMPT = [1, 403, 178, 261, 144, 230, 160, 297, 261, 125, 29, 450, 178, 471] * 3


def move(sender: Engine, receiver: Engine, moved, chunk_blocks: int = 3) -> None:
    """Everything a transfer does, in process: the receiver takes blocks, the chunks are
    written in order, and the receiver adopts them."""
    block_ids = take_blocks(receiver, engine_layout(sender), len(moved.token_ids))
    for first in range(0, len(moved.block_ids), chunk_blocks):
        data = read_moved(sender, moved, first, chunk_blocks)
        write_taken(receiver, block_ids[first : first + chunk_blocks], data)
    receiver.kv_cache.adopt(block_ids, moved.token_ids, moved.cache_salt, moved.session_id)
    release_moved(sender, moved)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "fp8"])
def test_block_bytes_round_trip_in_every_format(dtype: str) -> None:
    engine = make_engine(kv_cache_dtype=dtype)
    caches = engine.runner.kv_caches
    for key, value in caches:  # arbitrary bytes in every block
        for tensor in (key, value):
            raw = tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    data = read_blocks(caches, [5, 2, 7])
    assert len(data) == 3 * engine_layout(engine).block_bytes
    other = make_engine(kv_cache_dtype=dtype)
    write_blocks(other.runner.kv_caches, [1, 3, 4], data)
    for (k, v), (k2, v2) in zip(caches, other.runner.kv_caches, strict=True):
        for source, copied in ((k, k2), (v, v2)):
            assert torch.equal(
                source[[5, 2, 7]].view(torch.uint8), copied[[1, 3, 4]].view(torch.uint8)
            )
    with pytest.raises(ValueError, match="not 2 blocks"):
        write_blocks(other.runner.kv_caches, [0, 1], data)


def test_a_moved_session_continues_with_its_whole_history_cached() -> None:
    sender, receiver, undisturbed = make_engine(), make_engine(), make_engine()
    for engine in (sender, undisturbed):
        engine.add_request("turn-1", PROMPT, GREEDY, session_id="chat", cache_salt="tenant-a")
    first = run_to_completion(sender)["turn-1"]
    assert run_to_completion(undisturbed)["turn-1"] == first
    [session] = idle_sessions(sender)
    assert session.session_id == "chat" and session.token_ids == PROMPT + first[:-1]
    move(sender, receiver, session)
    assert sender.session_ids() == [] and receiver.session_ids() == ["chat"]
    assert sender.kv_cache.num_free_blocks == sender.kv_cache.num_blocks

    next_turn = PROMPT + first + [13, 176, 471]
    for engine in (receiver, undisturbed):
        engine.add_request("turn-2", next_turn, GREEDY, session_id="chat", cache_salt="tenant-a")
    outputs = {}
    for engine in (receiver, undisturbed):
        cached = []
        while engine.has_unfinished():
            for output in engine.step():
                outputs.setdefault(id(engine), []).extend(output.new_token_ids)
                cached.append(output.num_cached_tokens)
        assert cached[-1] == len(session.token_ids)  # all of its KV, none recomputed
    assert outputs[id(receiver)] == outputs[id(undisturbed)]


def test_a_running_request_moves_mid_generation_and_finishes_identically() -> None:
    sender, receiver, undisturbed = make_engine(), make_engine(), make_engine()
    undisturbed.add_request("r", PROMPT, GREEDY)
    expected = run_to_completion(undisturbed)["r"]
    sender.add_request("r", PROMPT, GREEDY)
    produced: list[int] = []
    while len(produced) < 9:
        for output in sender.step():
            produced.extend(output.new_token_ids)
    [moved] = take_sequences(sender)
    assert not sender.has_unfinished()
    assert (
        moved.request_id == "r" and moved.token_ids == (PROMPT + produced)[: len(moved.token_ids)]
    )
    move(sender, receiver, moved)
    assert sender.kv_cache.num_free_blocks == sender.kv_cache.num_blocks

    receiver.add_request("r", PROMPT, GREEDY, resume_token_ids=produced)
    rest, cached = [], []
    while receiver.has_unfinished():
        for output in receiver.step():
            rest.extend(output.new_token_ids)
            cached.append(output.num_cached_tokens)
    assert produced + rest == expected
    full_blocks = len(moved.token_ids) // 16 * 16
    assert cached[0] == full_blocks  # the prefix cache had every full block of it


def test_a_receiver_refuses_another_layout_naming_the_difference() -> None:
    sender = engine_layout(make_engine())
    receiver = make_engine(kv_cache_dtype="int8")
    with pytest.raises(KVRefused, match="kv_cache_dtype differs: the sender has 'float32'"):
        take_blocks(receiver, sender, 40)
    changes = (
        ("block_size", 32),
        ("model_id", "another-model"),
        ("num_layers", 3),
        ("weights_fingerprint", "0123456789abcdef"),  # the same name, other weights
    )
    for field, value in changes:
        changed = KVLayout(**{**_fields(engine_layout(receiver)), field: value})
        with pytest.raises(KVRefused, match=f"{field} differs"):
            take_blocks(receiver, changed, 40)


def test_a_receiver_with_no_room_refuses_and_keeps_what_it_holds() -> None:
    receiver = make_engine(num_gpu_blocks=4)
    receiver.add_request("busy", PROMPT, SamplingParams(max_tokens=2, temperature=0.0))
    receiver.step()
    before = receiver.kv_cache.num_free_blocks
    with pytest.raises(KVRefused, match="no room for 5 KV blocks"):
        take_blocks(receiver, engine_layout(receiver), 70)
    assert receiver.kv_cache.num_free_blocks == before
    run_to_completion(receiver)
    assert receiver.kv_cache.num_free_blocks == receiver.kv_cache.num_blocks


def _fields(layout: KVLayout) -> dict:
    return {name: getattr(layout, name) for name in KVLayout.__slots__}


def test_a_request_owing_its_prompt_logprobs_moves_no_kv() -> None:
    """Its next run recomputes the prompt for the logprobs anyway (no cached KV stands in)."""
    wants = greedy(24, prompt_logprobs=1)
    for params, moves_kv in ((wants, False), (GREEDY, True)):
        sender = make_engine(max_num_batched_tokens=16)  # the prompt takes three steps
        sender.add_request("r", PROMPT, params)
        sender.step()
        [moved] = take_sequences(sender)
        assert bool(moved.block_ids) == moves_kv
        release_moved(sender, moved)
        assert sender.kv_cache.num_free_blocks == sender.kv_cache.num_blocks


def test_the_weights_fingerprint_tells_two_checkpoints_of_one_name_apart(tmp_path) -> None:
    import shutil

    copy = tmp_path / "stories260K"
    shutil.copytree(STORIES_260K, copy)
    same = engine_layout(make_engine(copy))
    assert same == engine_layout(make_engine())  # the same weights elsewhere: one layout
    weights = next(copy.glob("*.safetensors"), None) or next(copy.glob("*.bin"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01  # the last byte of the last tensor
    weights.write_bytes(bytes(raw))
    changed = engine_layout(make_engine(copy))
    assert changed.model_id == same.model_id
    assert "weights_fingerprint differs" in changed.difference(same)
