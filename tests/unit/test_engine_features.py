"""Engine behaviour on stories260K: sessions, tenants, preemption, priority, chunking, bad input."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from common.prefix import block_hashes
from common.sampling_params import SamplingParams
from engine.engine import Engine
from tests.helpers import (
    STORIES_260K,
    greedy,
    make_engine,
    run_to_completion,
    step_outputs,
    wait_for,
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES_260K)


def assert_all_blocks_free(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, f"blocks still held: {stats}"


def test_session_turn_two_reuses_turn_one_and_matches_cold_run(tokenizer):
    turn1 = tokenizer("Once upon a time").input_ids
    engine = make_engine(block_size=4)
    engine.add_request("t1", turn1, greedy(20), session_id="s")
    reply1 = run_to_completion(engine)["t1"]
    assert engine.stats().num_session_pins == 1
    turn2 = turn1 + reply1 + tokenizer("Then the dog", add_special_tokens=False).input_ids
    engine.add_request("t2", turn2, greedy(20), session_id="s")
    outputs = step_outputs(engine)
    reply2 = [t for o in outputs for t in o.new_token_ids]
    # every token of turn 1 had its K/V computed except the last reply token, never fed back
    expected_cached = len(turn1) + len(reply1) - 1
    assert outputs[0].num_cached_tokens == expected_cached, (
        f"expected {expected_cached} cached tokens, got {outputs[0].num_cached_tokens}"
    )
    cold = make_engine(block_size=4, enable_prefix_caching=False)
    cold.add_request("cold", turn2, greedy(20))
    assert reply2 == run_to_completion(cold)["cold"], "session turn differs from a cold run"
    assert engine.release_session("s") is True
    assert engine.release_session("s") is False
    assert_all_blocks_free(engine)


def test_session_expires_after_ttl(tokenizer):
    engine = make_engine(session_ttl_s=0.05)
    engine.add_request("t1", tokenizer("Once upon a time").input_ids, greedy(4), session_id="s")
    run_to_completion(engine)
    assert engine.stats().num_session_pins == 1

    def expired() -> bool:
        engine.step()  # a step lets go of the sessions idle past their TTL
        return engine.stats().num_session_pins == 0

    wait_for(expired, "the session to expire 0.05 s after its turn")


def test_tenants_never_share_cached_blocks(tokenizer):
    prompt = tokenizer("The cat jumped over the fence and ran to the big house").input_ids
    engine = make_engine(block_size=4)
    engine.add_request("a1", prompt, greedy(4), cache_salt="tenant-a")
    run_to_completion(engine)
    engine.add_request("b1", prompt, greedy(4), cache_salt="tenant-b")
    engine.add_request("a2", prompt, greedy(4), cache_salt="tenant-a")
    cached = {o.request_id: o.num_cached_tokens for o in step_outputs(engine)}
    assert cached["b1"] == 0, f"tenant b read tenant a's blocks: {cached}"
    assert cached["a2"] > 0, f"tenant a did not reuse its own prefix: {cached}"


def test_preemption_keeps_every_request_correct(tokenizer):
    texts = ("Once upon a time", "The dog ran", "Mom said", "A big red ball", "Lily", "The sun")
    prompts = [tokenizer(t).input_ids for t in texts]
    free = make_engine(block_size=4)
    tight = make_engine(block_size=4, num_gpu_blocks=30)
    for engine in (free, tight):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, greedy(40))
    expected = run_to_completion(free)
    got = run_to_completion(tight)
    assert tight.stats().num_preemptions > 0, "the tight cache was expected to preempt"
    assert got == expected, "preempted requests produced different tokens"
    assert_all_blocks_free(tight)


def test_priority_runs_lower_value_first_fcfs_within(tokenizer):
    engine = make_engine(max_num_seqs=1)
    prompt = tokenizer("Once upon a time").input_ids
    for request_id, priority in [("late", 2), ("first", 0), ("mid-a", 1), ("mid-b", 1)]:
        engine.add_request(request_id, prompt, greedy(3), priority=priority)
    finished = [o.request_id for o in step_outputs(engine) if o.finished]
    assert finished == ["first", "mid-a", "mid-b", "late"], f"finish order {finished}"


def test_chunked_prefill_lets_running_requests_decode(tokenizer):
    engine = make_engine(max_num_batched_tokens=6)
    engine.add_request("short", tokenizer("Once").input_ids, greedy(30))
    engine.step()
    long_prompt = tokenizer("The cat jumped over the fence and ran to the big house where "
                            "the old man lived with his dog").input_ids  # fmt: skip
    engine.add_request("long", long_prompt, greedy(2))
    steps_until_long_starts = 0
    while True:
        outputs = {o.request_id: o for o in engine.step()}
        assert "short" in outputs, "the running request stalled during a chunked prefill"
        if "long" in outputs:
            break
        steps_until_long_starts += 1
    assert steps_until_long_starts >= 2, "the long prompt was expected to take several chunks"


def test_a_lone_prompt_in_chunks_gives_the_tokens_of_one_prefill(tokenizer):
    """Chunks that end no prompt, with nothing decoding beside them, ask the model's head for
    no rows."""
    prompt = tokenizer("The cat jumped over the fence and ran to the big house").input_ids
    whole = make_engine()
    whole.add_request("r", prompt, greedy(8))
    chunked = make_engine(max_num_batched_tokens=4)
    chunked.add_request("r", prompt, greedy(8))
    assert chunked.runner.kernels.name == "cpu"
    assert run_to_completion(chunked)["r"] == run_to_completion(whole)["r"]


def test_seeded_sampling_is_independent_of_batch_mates(tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)
    alone = make_engine()
    alone.add_request("x", prompt, params)
    expected = run_to_completion(alone)["x"]
    crowded = make_engine()
    crowded.add_request("noise1", tokenizer("The dog").input_ids, SamplingParams(max_tokens=30))
    crowded.add_request("x", prompt, params)
    crowded.add_request("noise2", prompt, SamplingParams(max_tokens=10, seed=7))
    assert run_to_completion(crowded)["x"] == expected


@pytest.mark.parametrize(
    "field, call",
    [
        ("prompt_token_ids", lambda e: e.add_request("bad", [], greedy(4))),
        ("prompt_token_ids", lambda e: e.add_request("bad", [5] * 600, greedy(4))),
        ("prompt_token_ids", lambda e: e.add_request("bad", [5, 99999], greedy(4))),
        ("max_tokens", lambda e: e.add_request("bad", [1, 5], SamplingParams(max_tokens=0))),
        ("temperature", lambda e: e.add_request("bad", [1], SamplingParams(temperature=-1))),
        ("top_p", lambda e: e.add_request("bad", [1], SamplingParams(top_p=0.0))),
        ("top_p", lambda e: e.add_request("bad", [1], SamplingParams(top_p=1.5))),
        ("top_k", lambda e: e.add_request("bad", [1], SamplingParams(top_k=-1))),
        ("request_id", lambda e: e.abort("nobody")),
        ("request_id", lambda e: e.add_request("good", [1, 5], greedy(4))),  # duplicate
        ("priority", lambda e: e.add_request("bad", [1], greedy(4), priority="high")),
        ("cache_salt", lambda e: e.add_request("bad", [1, 5], greedy(4), cache_salt=5)),
        ("prompt_token_ids", lambda e: e.add_request("bad", None, greedy(4))),
        ("session_id", lambda e: e.add_request("bad", [1, 5], greedy(4), session_id="")),
    ],
)
def test_bad_input_names_field_and_spares_others(tokenizer, field, call):
    engine = make_engine()
    prompt = tokenizer("Once upon a time").input_ids
    engine.add_request("good", prompt, greedy(12))
    engine.step()
    with pytest.raises(ValueError, match=field):
        call(engine)
    got = run_to_completion(engine)
    reference = make_engine()
    reference.add_request("good", prompt, greedy(12))
    assert got["good"][-11:] == run_to_completion(reference)["good"][-11:]
    assert_all_blocks_free(engine)


def test_abort_frees_blocks_and_stops_output(tokenizer):
    engine = make_engine()
    engine.add_request("a", tokenizer("Once upon a time").input_ids, greedy(50))
    engine.add_request("b", tokenizer("The dog").input_ids, greedy(5))
    engine.step()
    engine.abort("a")
    outputs = step_outputs(engine)
    assert {o.request_id for o in outputs} == {"b"}, "an aborted request kept producing"
    assert_all_blocks_free(engine)


def test_max_model_len_ends_with_length(tokenizer):
    engine = make_engine(max_model_len=16)
    prompt = tokenizer("Once upon a time").input_ids
    engine.add_request("a", prompt, greedy(100))
    outputs = step_outputs(engine)
    assert len(prompt) + len(outputs) == 16
    assert outputs[-1].finish_reason == "length"


def test_reported_cache_hashes_are_the_schedulers_prompt_hashes(tokenizer):
    engine = make_engine(block_size=4)
    prompt = tokenizer("The cat jumped over the fence and ran to the big house").input_ids
    engine.add_request("a", prompt, greedy(1), cache_salt="tenant-a")
    run_to_completion(engine)
    reported = set(engine.cached_block_hashes(limit=1000))
    expected = block_hashes(prompt, 4, "tenant-a")
    assert expected and set(expected) <= reported, (
        f"scheduler-side hashes {expected} not all reported in {sorted(reported)}"
    )
    assert not set(block_hashes(prompt, 4, "tenant-b")) & reported


def test_session_reuses_a_partial_last_block(tokenizer):
    engine = make_engine(block_size=4)
    turn1 = tokenizer("Once upon a time").input_ids
    engine.add_request("t1", turn1, greedy(7), session_id="s")
    reply1 = run_to_completion(engine)["t1"]
    kv_tokens = len(turn1) + len(reply1) - 1
    assert kv_tokens % 4, "the test needs turn 1 to end inside a block"
    turn2 = turn1 + reply1 + tokenizer("The end", add_special_tokens=False).input_ids
    engine.add_request("t2", turn2, greedy(12), session_id="s")
    outputs = step_outputs(engine)
    assert outputs[0].num_cached_tokens == kv_tokens, (
        f"expected {kv_tokens} cached tokens, got {outputs[0].num_cached_tokens}"
    )
    cold = make_engine(block_size=4, enable_prefix_caching=False)
    cold.add_request("cold", turn2, greedy(12))
    assert [t for o in outputs for t in o.new_token_ids] == run_to_completion(cold)["cold"]


def test_a_request_that_cannot_fit_leaves_session_pins_alone(tokenizer):
    engine = make_engine(block_size=4, num_gpu_blocks=24)
    engine.add_request("t1", tokenizer("Once upon a time").input_ids, greedy(6), session_id="s")
    run_to_completion(engine)
    engine.add_request("runner", tokenizer("The dog").input_ids, greedy(40))
    for _ in range(3):
        engine.step()
    engine.add_request("huge", [5] * 92, greedy(2))
    engine.step()
    stats = engine.stats()
    assert stats.num_waiting == 1, f"the 92-token prompt was not expected to fit: {stats}"
    assert stats.num_session_pins == 1, f"the session was evicted for nothing: {stats}"


def test_another_tenants_request_does_not_drop_a_session(tokenizer):
    engine = make_engine(block_size=4)
    prompt = tokenizer("Once upon a time").input_ids
    engine.add_request("a", prompt, greedy(6), session_id="s", cache_salt="tenant-a")
    run_to_completion(engine)
    engine.add_request("b", prompt, greedy(2), session_id="s2", cache_salt="tenant-b")
    engine.add_request("b2", prompt, greedy(2), session_id="s", cache_salt="tenant-b")
    outputs = {o.request_id: o for o in step_outputs(engine)}
    assert outputs["b2"].num_cached_tokens == 0, "tenant b read tenant a's session"
    # b's turn pinned a session "s" of its own: a's is still there, and each ends alone
    assert sorted(engine.session_ids()) == ["s", "s", "s2"], engine.session_ids()
    assert engine.release_session("s", "tenant-a"), "tenant b's turn dropped a's session"
    assert engine.release_session("s", "tenant-b"), "b's own session was not pinned"


def test_release_session_is_scoped_to_its_tenant(tokenizer):
    engine = make_engine()
    engine.add_request(
        "a", tokenizer("Once").input_ids, greedy(3), session_id="s", cache_salt="t-a"
    )
    run_to_completion(engine)
    assert engine.release_session("s", "t-b") is False, "another tenant released the session"
    assert engine.release_session("s", "t-a") is True


@pytest.mark.parametrize("state", ["running", "waiting"])
def test_a_turn_that_finishes_after_its_session_ended_frees_its_blocks(tokenizer, state):
    """The session's end (EndSession) can reach the executor while its turn still runs: the
    turn must not pin the session again when it finishes."""
    engine = make_engine(max_num_seqs=1)
    prompt = tokenizer("Once upon a time").input_ids
    engine.add_request("other", prompt, greedy(4))
    engine.add_request("turn", prompt, greedy(6), session_id="s", cache_salt="t-a")
    engine.add_request("kept", prompt, greedy(3), session_id="k", cache_salt="t-a")
    engine.step()
    while state == "running" and "turn" not in [r.request_id for r in engine.scheduler.running]:
        engine.step()
    assert engine.release_session("s", "t-a") is False, "no pin yet: the turn had not finished"
    run_to_completion(engine)
    assert engine.session_ids() == ["k"], f"ended session pinned again: {engine.session_ids()}"
    engine.release_session("k", "t-a")
    assert_all_blocks_free(engine)


def test_decodes_keep_running_beside_a_higher_priority_long_prompt(tokenizer):
    engine = make_engine(max_num_batched_tokens=6)
    engine.add_request("short", tokenizer("Once").input_ids, greedy(30), priority=5)
    engine.step()
    engine.add_request("long", [5] * 60, greedy(2), priority=-1)
    for step in range(8):
        produced = {o.request_id for o in engine.step()}
        assert "short" in produced, f"the decode stalled at step {step} of the long prefill"


def test_unsupported_architecture_and_missing_weights_are_named(tmp_path):
    config = {"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 8, "hidden_size": 8,
              "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        make_engine(model=str(tmp_path))
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        make_engine(model=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_engine(model=str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("architecture", "keys", "want"),
    [
        ("LlamaForCausalLM", {}, (False, False, False)),
        ("LlamaForCausalLM", {"attention_bias": True}, (True, True, False)),
        ("LlamaForCausalLM", {"mlp_bias": True}, (False, False, True)),
        ("Qwen2ForCausalLM", {}, (True, False, False)),
        ("MistralForCausalLM", {"attention_bias": True, "mlp_bias": True}, (False, False, False)),
    ],
)
def test_bias_switches_follow_each_architecture(tmp_path, architecture, keys, want):
    """(q/k/v bias, o_proj bias, MLP biases) as the Hugging Face classes build them."""
    import json

    from engine.models.config import load_model_config

    raw = dict(
        architectures=[architecture], vocab_size=32, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, **keys,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert (config.qkv_bias, config.o_proj_bias, config.mlp_bias) == want
