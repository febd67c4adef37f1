"""Sequence groups (SamplingParams.n, best_of) on the engine: n choices of one request share
the prompt's KV blocks copy-on-write and equal what separate requests produce."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.choices import choice_request_id
from common.sampling_params import MAX_N, SamplingParamError, SamplingParams, choice_seed
from engine.kv_cache import KVCacheManager
from engine.kv_swap import BlockCopy
from engine.request import Request
from tests.helpers import greedy, make_engine, randomize_weights

PROMPT = [1, 403, 407, 261, 378, 275, 263, 271, 379, 290, 297, 263, 384, 271, 432, 269, 438]


def _choices(engine, max_steps: int = 10_000) -> dict[tuple[str, int], list[int]]:
    """Step until done; tokens per (request id, choice index)."""
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens
        for output in engine.step():
            tokens.setdefault((output.request_id, output.index), []).extend(output.new_token_ids)
    raise AssertionError(f"engine still had unfinished requests after {max_steps} steps")


def _held_blocks(engine) -> int:
    """Blocks some request holds, as the block manager counts them."""
    kv = engine.kv_cache
    return sum(1 for block in kv.blocks if block.ref_count > 0)


def test_greedy_n4_equals_four_separate_requests():
    engine = make_engine(block_size=4)
    engine.add_request("group", PROMPT, greedy(24, n=4))
    grouped = _choices(engine)
    for i in range(4):
        engine.add_request(f"alone{i}", PROMPT, greedy(24))
    alone = _choices(engine)
    assert sorted(grouped) == [("group", i) for i in range(4)], grouped.keys()
    for i in range(4):
        assert grouped[("group", i)] == alone[(f"alone{i}", 0)], (
            f"choice {i}: expected the separate request's tokens {alone[(f'alone{i}', 0)]}, "
            f"got {grouped[('group', i)]}"
        )


def test_seeded_choices_are_reproducible_and_each_its_own_stream():
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True, n=3)
    runs = []
    for _ in range(2):
        engine = make_engine(block_size=4)
        engine.add_request("r", PROMPT, params)
        runs.append(_choices(engine))
    assert runs[0] == runs[1], "a seeded group must sample the same choices twice"
    choices = [runs[0][("r", i)] for i in range(3)]
    assert len({tuple(c) for c in choices}) == 3, f"choices should differ, got {choices}"
    engine = make_engine(block_size=4)
    for i in range(3):
        seed = choice_seed(1234, i)
        alone = SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)
        engine.add_request(f"alone{i}", PROMPT, alone)
    alone = _choices(engine)
    for i in range(3):
        assert choices[i] == alone[(f"alone{i}", 0)], f"choice {i} is not seed {i}'s stream"


def test_resumed_choice_continues_its_own_stream():
    """A choice run again alone (choice_index, its own tokens) finishes as in the group."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True, n=3)
    engine = make_engine(block_size=4)
    engine.add_request("r", PROMPT, params)
    whole = _choices(engine)[("r", 2)]
    one = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request(
        choice_request_id("r", 2), PROMPT, one, resume_token_ids=whole[:5], choice_index=2
    )
    resumed = _choices(engine)
    assert resumed == {(choice_request_id("r", 2), 2): whole[5:]}, resumed


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A seeded random-weight Llama with room for a 1,000-token prompt."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    randomize_weights(model, seed=3)
    path = tmp_path_factory.mktemp("long-llama")
    model.save_pretrained(path)
    return path


def test_n8_on_a_1000_token_prompt_holds_at_most_1_2x_the_prompt_blocks(long_context_model):
    engine = make_engine(long_context_model, block_size=16, max_num_batched_tokens=1024)
    prompt = torch.randint(3, 256, (1000,), generator=torch.Generator().manual_seed(5)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, ignore_eos=True, n=8, seed=1))
    prompt_blocks = -(-len(prompt) // 16)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, _held_blocks(engine))
    assert engine.stats().num_preemptions == 0
    assert peak <= 1.2 * prompt_blocks, (
        f"n=8 held {peak} blocks at its peak; the prompt alone takes {prompt_blocks}, "
        f"so at most {1.2 * prompt_blocks:.0f} were expected"
    )


def _request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(num_tokens)), SamplingParams(), 0)


def test_fork_shares_blocks_and_copies_the_partial_one_on_first_write():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    parent, child = _request("p", 10), _request("c", 10)
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10  # 2 full blocks and one holding 2 tokens
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [kv.blocks[b].ref_count for b in parent.block_table] == [2, 2, 2]
    assert kv.num_free_blocks == 13, "a fork takes no new block"

    child.all_token_ids.append(99)
    assert kv.allocate_slots(child, 1)  # writes position 10: into the shared partial block
    tail = parent.block_table[2]
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != tail, "the child must write into a copy of its own"
    assert kv.host.take_ops() == [BlockCopy(tail, child.block_table[2])]
    assert kv.blocks[tail].ref_count == 1

    parent.all_token_ids.append(98)
    assert kv.allocate_slots(parent, 1)  # the last holder writes in place
    assert parent.block_table[2] == tail
    assert kv.host.take_ops() == [], "the last holder of a block must not copy it"


def test_fork_at_a_block_boundary_copies_nothing():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    parent, child = _request("p", 8), _request("c", 8)
    assert kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    kv.fork(parent, child)
    child.all_token_ids.append(99)
    assert kv.allocate_slots(child, 1)
    assert kv.host.take_ops() == []
    assert len(child.block_table) == 3 and child.block_table[:2] == parent.block_table


def test_copy_on_write_copies_the_block_contents():
    engine = make_engine(block_size=4)
    kv_caches = engine.runner.kv_caches
    for layer in kv_caches:
        for tensor in layer:
            tensor[3] = torch.randn(tensor[3].shape)
    engine.kv_cache.host.copy_block(3, 5)
    engine.runner.swap_blocks(engine.kv_cache.host.take_ops())
    for layer in kv_caches:
        for tensor in layer:
            assert torch.equal(tensor[5], tensor[3])


def test_preempting_one_sequence_of_a_group_keeps_every_choice_right():
    # 12 blocks of 4 tokens: four choices of 17 + 24 tokens cannot all hold their blocks
    engine = make_engine(block_size=4, num_gpu_blocks=12, enable_prefix_caching=False)
    engine.add_request("group", PROMPT, greedy(24, n=4))
    grouped = _choices(engine)
    assert engine.stats().num_preemptions > 0, "the test must preempt a sequence"
    engine = make_engine(block_size=4)
    engine.add_request("alone", PROMPT, greedy(24))
    alone = _choices(engine)[("alone", 0)]
    for i in range(4):
        assert grouped[("group", i)] == alone, f"choice {i} after preemption"


def test_preemption_with_swap_keeps_every_choice_right():
    engine = make_engine(
        block_size=4, num_gpu_blocks=12, enable_prefix_caching=False, swap_space_gib=0.001
    )
    engine.add_request("group", PROMPT, greedy(24, n=4))
    grouped = _choices(engine)
    assert engine.stats().num_swapped_out_blocks > 0, "the test must swap a sequence out"
    engine = make_engine(block_size=4)
    engine.add_request("alone", PROMPT, greedy(24))
    alone = _choices(engine)[("alone", 0)]
    assert all(grouped[("group", i)] == alone for i in range(4)), grouped


def test_abort_one_choice_and_a_choice_before_the_fork():
    engine = make_engine(block_size=4)
    engine.add_request("g", PROMPT, greedy(8, n=3))
    engine.abort(choice_request_id("g", 1))  # not forked yet: it never starts
    first = engine.step()
    assert sorted(o.index for o in first) == [0, 2]
    engine.abort(choice_request_id("g", 2))
    rest = _choices(engine)
    assert set(rest) == {("g", 0)} and len(rest[("g", 0)]) == 7
    assert _held_blocks(engine) == 0


def test_abort_by_request_id_stops_every_choice():
    engine = make_engine(block_size=4)
    engine.add_request("g", PROMPT, greedy(8, n=3))
    engine.step()
    engine.abort("g")
    assert not engine.has_unfinished() and _held_blocks(engine) == 0
    with pytest.raises(ValueError, match="request_id"):
        engine.abort("g")


def test_best_of_runs_every_sequence_with_logprobs():
    engine = make_engine(block_size=4)
    params = SamplingParams(max_tokens=6, seed=3, ignore_eos=True, n=2, best_of=4, logprobs=0)
    engine.add_request("b", PROMPT, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert sorted({o.index for o in outputs}) == [0, 1, 2, 3]
    assert all(o.logprobs and len(o.logprobs) == 1 for o in outputs)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        (dict(n=0), "n"),
        (dict(n=MAX_N + 1), "n"),
        (dict(n=True), "n"),
        (dict(n=4, best_of=2), "best_of"),
        (dict(best_of=MAX_N + 1), "best_of"),
    ],
)
def test_n_and_best_of_out_of_range_name_the_field(fields, name):
    with pytest.raises(SamplingParamError) as refused:
        SamplingParams(**fields)
    assert refused.value.field == name


def test_more_sequences_than_the_batch_holds_is_refused_naming_n():
    engine = make_engine(max_num_seqs=4)
    with pytest.raises(ValueError, match=r"params\.n \(8\) must be <= max_num_seqs"):
        engine.add_request("r", PROMPT, greedy(4, n=8))
    with pytest.raises(ValueError, match=r"params\.best_of"):
        engine.add_request("r", PROMPT, greedy(4, n=2, best_of=5))
    with pytest.raises(ValueError, match="resume_token_ids"):
        engine.add_request("r", PROMPT, greedy(4, n=2), resume_token_ids=[5])
    engine.add_request("r", PROMPT, greedy(4, n=4))  # the engine still serves
    assert len(_choices(engine)) == 4


def test_without_copy_on_write_a_fork_recomputes_the_partial_block():
    """Tensor-parallel ranks do not see block copies: forks share full blocks only."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False,
                        copy_on_write=False)  # fmt: skip
    parent, child = _request("p", 10), _request("c", 10)
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    kv.fork(parent, child)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    engine = make_engine(block_size=4)
    engine.kv_cache.copy_on_write = False
    engine.add_request("group", PROMPT, greedy(12, n=3))
    grouped = _choices(engine)
    engine.add_request("alone", PROMPT, greedy(12))
    alone = _choices(engine)[("alone", 0)]
    assert all(grouped[("group", i)] == alone for i in range(3)), grouped
    assert engine.kv_cache.host.take_ops() == []


def test_choice_0_keeps_the_session_for_the_next_turn():
    engine = make_engine(block_size=4)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, n=3)
    engine.add_request("turn1", PROMPT, params, session_id="s")
    first = _choices(engine)
    assert engine.session_ids() == ["s"]
    (session,) = engine.kv_cache.sessions.values()
    assert session.token_ids == (PROMPT + first[("turn1", 0)])[: len(session.token_ids)]
    assert len(session.token_ids) == len(PROMPT) + 7, "choice 0's tokens but the last"
    turn2 = PROMPT + first[("turn1", 0)] + [300, 301]
    engine.add_request("turn2", turn2, greedy(2), session_id="s")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[0].num_cached_tokens == len(PROMPT) + 7, outputs[0]


def test_a_request_whose_choice_ids_are_in_use_is_refused():
    engine = make_engine(block_size=4)
    engine.add_request(choice_request_id("g", 1), PROMPT, greedy(4), choice_index=1)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("g", PROMPT, greedy(4, n=2))
    engine.add_request("h", PROMPT, greedy(4, n=2))  # not forked yet: its choices are its own
    for index in (0, 1):
        with pytest.raises(ValueError, match="already in use"):
            one = greedy(4)
            engine.add_request(choice_request_id("h", index), PROMPT, one, choice_index=index)


def test_seats_of_forks_to_come_count_against_max_num_seqs():
    """A group still computing its prompt holds seats for its forks: requests admitted
    meanwhile never push the running sequences past max_num_seqs."""
    engine = make_engine(block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    engine.add_request("group", PROMPT, greedy(6, n=4))  # 17 prompt tokens: 3 chunks of 8
    for i in range(3):
        engine.add_request(f"other{i}", PROMPT[:3], greedy(6))
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 4, f"at most 4 sequences may run, {most} did"


def test_choice_0_run_again_alone_beside_its_unforked_group():
    """An executor given choice 0 alone (with its client's tokens) while the group restarted
    there has not forked yet stops that group's choice 0 and runs the one alone."""
    engine = make_engine(block_size=4)
    engine.add_request("ref", PROMPT, greedy(8))
    alone = _choices(engine)[("ref", 0)]
    engine.add_request("g", PROMPT, greedy(8, n=3))
    engine.abort(choice_request_id("g", 0))
    engine.add_request(
        choice_request_id("g", 0), PROMPT, greedy(8), resume_token_ids=alone[:3], choice_index=0
    )
    tokens = _choices(engine)
    assert sorted(tokens) == [("g", 1), ("g", 2), (choice_request_id("g", 0), 0)], tokens.keys()
    assert tokens[(choice_request_id("g", 0), 0)] == alone[3:], "choice 0 did not resume"
    assert _held_blocks(engine) == 0


def test_abort_of_a_choice_run_alone_stops_it_not_the_unforked_group():
    """A choice run alone under its own id while its group has not forked: an abort of that
    id stops the run alone (the group's choice of that index was stopped already)."""
    engine = make_engine(block_size=4)
    engine.add_request("g", PROMPT, greedy(8, n=3))
    engine.abort(choice_request_id("g", 1))
    engine.add_request(choice_request_id("g", 1), PROMPT, greedy(8), choice_index=1)
    engine.abort(choice_request_id("g", 1))
    tokens = _choices(engine)
    assert sorted(tokens) == [("g", 0), ("g", 2)], f"the aborted run alone went on: {tokens}"
    assert _held_blocks(engine) == 0
