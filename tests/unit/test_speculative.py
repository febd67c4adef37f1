"""Speculative decoding on the real stories260K engine: the output with n-gram proposals is the
output without them (greedy, and seeded sampling token for token), the KV cache is rolled
back to what a run without proposals holds, and the rule that skips proposals works."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.decoding import quote_prompt
from common.constraints import Constraint, ConstraintKind
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from deploy.models import default_gguf_path
from engine.config import EngineConfig, pop_engine_config
from engine.engine import Engine
from engine.generate import main as generate_main
from engine.request import Request
from engine.speculative import NgramProposer, propose_ngram
from engine.speculative_config import SpeculativeConfig
from executor.config import ExecutorConfig
from executor.metrics import ExecutorMetrics
from tests.helpers import (
    STORIES_260K,
    greedy,
    hf_generate,
    make_engine,
    one_torch_thread,
    step_outputs,
)

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside. "
    "One day, Lily saw a big red ball. "
)
# Lets every request propose: the rule is tested on its own below.
ALWAYS = SpeculativeConfig(min_acceptance_rate=0.0, disable_by_batch_size=64)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES_260K)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Prompts that repeat themselves (proposals get accepted) and ones that do not."""
    texts = [
        "The dog ran and ran and ran and ran and",
        "Lily and Ben went to the park. They",
        STORY * 3,
        "The fish swam",
    ]
    return [tokenizer(t).input_ids for t in texts]


def run(
    prompts: list[list[int]],
    params: SamplingParams,
    spec: SpeculativeConfig | None,
    **engine_fields,
) -> tuple[dict[str, list], Engine]:
    """Each prompt's (tokens, logprobs, finish reasons) by request id, and the engine."""
    engine = make_engine(speculative_config=spec, **engine_fields)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return drain(engine), engine


def drain(engine: Engine) -> dict[str, list]:
    """Every choice's tokens, logprobs and finish reasons, stepped to the end."""
    got: dict[str, list] = {}
    for out in step_outputs(engine):
        key = f"{out.request_id}/{out.index}"
        tokens, logprobs, reasons = got.setdefault(key, ([], [], []))
        tokens += out.new_token_ids
        logprobs += out.logprobs or []
        reasons.append(out.finish_reason)
    return got


def assert_same(without: dict, with_spec: dict) -> None:
    assert with_spec.keys() == without.keys()
    for key, (tokens, logprobs, reasons) in without.items():
        got_tokens, got_logprobs, got_reasons = with_spec[key]
        assert got_tokens == tokens, f"{key}: expected {tokens}\ngot      {got_tokens}"
        assert got_reasons[-1] == reasons[-1], f"{key}: finish {reasons[-1]} vs {got_reasons[-1]}"
        assert len(got_logprobs) == len(logprobs)
        for want, got in zip(logprobs, got_logprobs, strict=True):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]


def accepted(engine: Engine) -> int:
    return engine.stats().num_spec_accepted_tokens


# ---- configuration ------------------------------------------------------------------------


def test_config_from_vllm_json():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 1}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (3, 5)
    assert config.prompt_lookup_min == 1


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"method": "eagle"}', "speculative_config.method"),
        ('{"num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 4}', "config.prompt_lookup_min"),
        ('{"model": "/models/draft", "num_speculative_tokens": 4}', "speculative_config.model"),
        ('{"lookahead": 2}', "speculative_config.lookahead"),
        ('{"min_acceptance_rate": 2}', "speculative_config.min_acceptance_rate"),
        ("[4]", "speculative_config must be a JSON object"),
        ("{", "speculative_config must be a JSON object"),
    ],
)
def test_bad_config_names_the_key(text, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_json(text)


def test_flag_parses_and_names_itself():
    base = {"model": STORIES_260K, "max_model_len": 0, "num_gpu_blocks": 0, "dtype": "auto"}
    config = pop_engine_config({**base, "speculative_config": '{"method": "ngram"}'})
    assert config.speculative_config == SpeculativeConfig()
    assert pop_engine_config({**base, "speculative_config": ""}).speculative_config is None
    with pytest.raises(ValueError, match="--speculative-config: speculative_config.method"):
        pop_engine_config({**base, "speculative_config": '{"method": "draft"}'})


def test_executor_flag_and_environment(monkeypatch):
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    config = ExecutorConfig.from_args(["--model", str(STORIES_260K), "--speculative-config", text])
    assert config.engine.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    monkeypatch.setenv("KVGATE_SPECULATIVE_CONFIG", text)  # as `make run` passes it on
    config = ExecutorConfig.from_args(["--model", str(STORIES_260K)])
    assert config.engine.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    monkeypatch.setenv("KVGATE_SPECULATIVE_CONFIG", '{"num_speculative_tokens": 99}')
    with pytest.raises(ValueError, match="--speculative-config: .*num_speculative_tokens"):
        ExecutorConfig.from_args(["--model", str(STORIES_260K)])


def test_generate_command_with_speculation(capsys):
    argv = ["--model", str(STORIES_260K), "--prompt", "The dog ran and ran and ran and"]
    argv += ["--max-tokens", "40", "--ignore-eos"]
    assert generate_main(argv) == 0
    plain = capsys.readouterr().out
    assert generate_main([*argv, "--speculative-config", '{"method": "ngram"}']) == 0
    assert capsys.readouterr().out == plain
    assert generate_main([*argv, "--speculative-config", '{"model": "draft"}']) == 2
    assert "speculative_config.model" in capsys.readouterr().err


def test_ngram_lookup_takes_the_longest_latest_suffix_match():
    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 4, 2, 3]
    # the suffix [2, 3] occurs twice before: the latest one is followed by 7, 8, 4
    assert propose_ngram(tokens, 1, 4, 3) == [7, 8, 4]
    # [4, 2, 3] occurs nowhere before, [2, 3] does
    assert propose_ngram(tokens + [7], 2, 4, 2) == [8, 4]
    assert propose_ngram([5, 6, 7, 8], 1, 3, 4) == []
    assert propose_ngram(tokens, 3, 4, 3) == []  # only a 2-token match: below the minimum


def test_proposals_end_before_a_stop_token_and_within_max_tokens():
    tokens = [5, 6, 7, 8, 2, 9, 5, 6]  # the suffix 5, 6 was followed by 7, 8, 2 (EOS), 9

    def proposal(**params) -> list[int]:
        proposer = NgramProposer(SpeculativeConfig(), max_model_len=100, eos_token_ids=[2])
        req = Request("r", tokens[:1], SamplingParams(**params), 0, all_token_ids=list(tokens))
        req.num_computed_tokens = len(tokens) - 1
        return proposer.propose([req]).get("r", [])

    assert proposal(max_tokens=50) == [7, 8]
    assert proposal(max_tokens=50, stop_token_ids=[8]) == [7]
    assert proposal(max_tokens=9) == [7]  # 7 produced, 1 this step's own: room for 1
    assert proposal(max_tokens=8) == []
    assert proposal(max_tokens=50, temperature=1.5) == []  # the rule: too hot


# ---- greedy ---------------------------------------------------------------------------------


def test_greedy_tokens_identical_with_and_without_proposals(prompts):
    without, _ = run(prompts, greedy(80, logprobs=2), None)
    with_spec, engine = run(prompts, greedy(80, logprobs=2), ALWAYS)
    assert_same(without, with_spec)
    stats = engine.stats()
    assert stats.num_spec_accepted_tokens > 0, "no proposal was accepted on repeating prompts"
    assert stats.num_spec_proposed_tokens > stats.num_spec_accepted_tokens
    assert stats.num_free_blocks == stats.num_total_blocks  # every block came back


def test_greedy_with_proposals_equals_transformers(tokenizer, prompts):
    hf_model = AutoModelForCausalLM.from_pretrained(STORIES_260K, dtype=torch.float32).eval()
    engine = make_engine(speculative_config=ALWAYS)
    engine.add_request("story", prompts[0], greedy(100))
    got = drain(engine)["story/0"][0]
    assert accepted(engine) > 0
    expected = hf_generate(hf_model, prompts[0], 100)
    decode = tokenizer.decode
    assert got == expected, f"expected {decode(expected)!r}\ngot {decode(got)!r}"


# The first two paragraphs of the quoting benchmark's text (155 tokens on SmolLM2)
QUOTE_TOKENS = 200


def test_smollm2_quoting_greedy_identical_and_accepted():
    path = default_gguf_path()
    assert path.is_file(), f"{path} is missing: `make setup` fetches it (deploy/fetch_model.py)"
    prompt = quote_prompt(ModelText(str(path)), QUOTE_TOKENS)
    results, engines = [], []
    with one_torch_thread():
        for spec in (None, ALWAYS):
            engine = make_engine(path, kv_cache_gib=0.05, speculative_config=spec)
            engine.add_request("quote", prompt, greedy(24, logprobs=1))
            results.append(drain(engine))
            engines.append(engine)
    assert_same(*results)
    stats = engines[1].stats()
    assert stats.num_spec_accepted_tokens >= 12, stats  # the model copies its prompt


# ---- rollback -------------------------------------------------------------------------------


class ForcedProposer(NgramProposer):
    """Proposes `k` tokens whose first `num_right` are the target's own (from a run without
    proposals) and the rest wrong: the rejection comes at position `num_right`."""

    def __init__(self, engine: Engine, truth: list[int], num_right: int, k: int = 4) -> None:
        super().__init__(ALWAYS, engine.max_model_len, [])
        self.truth, self.num_right, self.k = truth, num_right, k
        self.lengths: list[int] = []  # of each proposal made

    def _propose(self, req) -> list[int]:
        done = req.num_output_tokens
        right = self.truth[done : done + self.num_right]
        wrong = [(t + 1) % 512 for t in self.truth[done + len(right) : done + self.k]]
        room = req.params.max_tokens - done - 1
        proposal = (right + wrong)[:room]
        self.lengths += [len(proposal)] if proposal else []
        return proposal


def cache_state(engine: Engine, req_id: str) -> tuple:
    req = engine.requests.get(req_id)
    kv = engine.kv_cache
    return (req.num_computed_tokens, len(req.block_table), kv.num_free_blocks,
            sorted(kv._hash_to_block))  # fmt: skip


def states_by_length(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[dict, list]:
    """The cache's state after each step by the request's token count, and its tokens."""
    engine.add_request("r", prompt, greedy(max_tokens))
    states, tokens = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        if engine.has_unfinished():
            states[engine.requests.get("r").num_tokens] = cache_state(engine, "r")
    return states, tokens


@pytest.mark.parametrize("num_right", [0, 1, 2, 3, 4])
def test_rejection_at_each_position_rolls_the_cache_back(prompts, num_right):
    prompt, max_tokens = prompts[1], 40
    plain = make_engine(num_gpu_blocks=64, block_size=4)
    expected_states, truth = states_by_length(plain, prompt, max_tokens)
    engine = make_engine(num_gpu_blocks=64, block_size=4, speculative_config=ALWAYS)
    engine.proposer = proposer = ForcedProposer(engine, truth, num_right)
    states, tokens = states_by_length(engine, prompt, max_tokens)
    assert tokens == truth
    stats = engine.stats()
    assert stats.num_spec_drafts == len(proposer.lengths) > 0
    assert stats.num_spec_accepted_tokens == sum(min(num_right, n) for n in proposer.lengths)
    assert stats.num_spec_bonus_tokens == sum(n <= num_right for n in proposer.lengths)
    for length, state in states.items():
        assert state == expected_states[length], f"after {length} tokens: {state} vs plain"
    assert stats.num_free_blocks == plain.stats().num_free_blocks


# ---- sampling -------------------------------------------------------------------------------


def test_seeded_sampling_identical_over_many_seeds(prompts):
    """The verifier samples each proposed position with the draws the run without proposals
    uses, so every seed gives the same tokens: the output distribution is the target's."""
    results, engines = [], []
    for spec in (None, ALWAYS):
        engine = make_engine(speculative_config=spec)
        for seed in range(16):
            params = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=seed)
            engine.add_request(f"s{seed}", prompts[seed % 2], params)
        results.append(drain(engine))
        engines.append(engine)
    assert_same(*results)
    assert accepted(engines[1]) > 0
    assert len({tuple(tokens) for tokens, _, _ in results[0].values()}) > 2  # seeds differ


def test_penalties_stops_and_limits_kept(prompts, tokenizer):
    stop_id = tokenizer(" ball").input_ids[-1]
    params = SamplingParams(
        max_tokens=50, temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2,
        presence_penalty=0.1, min_tokens=10, stop_token_ids=[stop_id], logprobs=1,
        logit_bias={stop_id: 2.0},
    )  # fmt: skip
    without, _ = run(prompts, params, None)
    with_spec, engine = run(prompts, params, ALWAYS)
    assert_same(without, with_spec)
    assert engine.stats().num_spec_drafts > 0
    short, engine = run(prompts, greedy(7), ALWAYS)
    assert all(len(tokens) == 7 for tokens, _, _ in short.values())


def test_prompt_logprobs_kept(prompts):
    got = []
    for spec in (None, ALWAYS):
        engine = make_engine(speculative_config=spec)
        engine.add_request("p", prompts[0], greedy(60, prompt_logprobs=2))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        got.append(([t for o in outputs for t in o.new_token_ids], outputs[0].prompt_logprobs))
        assert all(o.prompt_logprobs is None for o in outputs[1:])
    assert accepted(engine) > 0
    (tokens, prompt_logprobs), (spec_tokens, spec_prompt_logprobs) = got
    assert spec_tokens == tokens
    assert len(spec_prompt_logprobs) == len(prompts[0]) - 1
    assert [e.token_id for e in spec_prompt_logprobs] == [e.token_id for e in prompt_logprobs]


def test_structured_constraint_with_proposals(prompts):
    regex = Constraint(ConstraintKind.REGEX, "(Lily saw a big red ball\\. )+")
    results = []
    for spec in (None, ALWAYS):
        params = [SamplingParams(max_tokens=40, temperature=0.8, seed=s, constraint=regex)
                  for s in range(3)]  # fmt: skip
        engine = make_engine(speculative_config=spec)
        for i, p in enumerate(params):
            engine.add_request(f"c{i}", prompts[1], p)
        results.append(drain(engine))
    assert_same(*results)
    assert accepted(engine) > 0, "the repeating constraint should make proposals acceptable"


def test_sequence_groups_preemption_and_prefix_cache(prompts):
    params = SamplingParams(max_tokens=60, temperature=0.9, seed=5, n=3)
    results, engines = [], []
    for spec in (None, ALWAYS):
        # few blocks: requests are preempted and recomputed
        result, engine = run([prompts[0], prompts[0], prompts[2]], params, spec,
                             num_gpu_blocks=40, block_size=8)  # fmt: skip
        engine.add_request("again", prompts[2], greedy(30))  # its prompt's blocks are cached
        result.update(drain(engine))
        results.append(result)
        engines.append(engine)
    assert_same(*results)
    plain, spec = (e.stats() for e in engines)
    assert plain.num_preemptions > 0
    assert spec.num_spec_accepted_tokens > 0
    assert spec.prefix_hit_tokens == plain.prefix_hit_tokens > 0
    assert spec.num_free_blocks == plain.num_free_blocks


def test_resumed_seeded_request_and_abort(prompts):
    """A seeded request resumed with the tokens an earlier run gave continues that run (its
    generator skips their draws); an abort in the middle gives every block back."""
    params = SamplingParams(max_tokens=50, temperature=0.8, seed=11)
    whole, _ = run(prompts[:1], params, ALWAYS)
    tokens = whole["r0/0"][0]
    engine = make_engine(speculative_config=ALWAYS)
    engine.add_request("resumed", prompts[0], params, resume_token_ids=tokens[:20])
    assert drain(engine)["resumed/0"][0] == tokens[20:]
    engine.add_request("aborted", prompts[0], greedy(200))
    while engine.has_unfinished() and engine.stats().num_spec_drafts < 3:
        engine.step()
    assert engine.has_unfinished(), "the request ended before three drafts"
    engine.abort("aborted")
    stats = engine.stats()
    assert stats.num_free_blocks + stats.num_session_blocks == stats.num_total_blocks


# ---- draft model ----------------------------------------------------------------------------


def test_draft_model_output_identical_and_its_cache_freed(prompts):
    """stories260K drafting for itself: greedy proposals are all accepted; seeded sampling
    keeps its tokens; the draft's shadows leave its cache once their requests end."""
    draft = SpeculativeConfig.from_json(json.dumps({"model": str(STORIES_260K)}))
    assert draft.method == "draft_model"
    draft = replace(draft, min_acceptance_rate=0.0, disable_by_batch_size=64)
    for params in (greedy(40, logprobs=1), SamplingParams(max_tokens=40, temperature=0.8, seed=3)):
        without, _ = run(prompts[:2], params, None)
        with_spec, engine = run(prompts[:2], params, draft)
        assert_same(without, with_spec)
        stats = engine.stats()
        assert stats.spec_method == "draft_model" and stats.num_spec_accepted_tokens > 0
        if params.is_greedy:
            assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens
        engine.step()  # a step with nothing running forgets the finished requests' shadows
        draft_cache = engine.proposer.kv_cache
        assert draft_cache.num_free_blocks == draft_cache.num_blocks


def test_draft_model_with_another_tokenizer_is_refused():
    smollm2 = default_gguf_path()
    assert smollm2.is_file(), f"{smollm2} is missing: `make setup` fetches it"
    draft = SpeculativeConfig.from_json(json.dumps({"model": str(smollm2)}))
    with pytest.raises(ValueError, match="speculative_config.model .* another tokenizer"):
        make_engine(speculative_config=draft)
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig(method="ngram", model=str(STORIES_260K))


# ---- the rule -------------------------------------------------------------------------------


def test_no_proposals_for_a_large_batch_or_a_hot_temperature(prompts):
    crowded = SpeculativeConfig(disable_by_batch_size=len(prompts) - 1, min_acceptance_rate=0)
    _, engine = run(prompts, greedy(20), crowded)
    assert engine.stats().num_spec_drafts == 0
    hot = SamplingParams(max_tokens=20, temperature=1.5, seed=1)
    _, engine = run(prompts[:1], hot, SpeculativeConfig(max_temperature=1.0))
    assert engine.stats().num_spec_drafts == 0


def test_low_acceptance_stops_proposals_then_retries(prompts):
    max_tokens = 40
    _, truth = states_by_length(make_engine(), prompts[1], max_tokens)
    rule = SpeculativeConfig(min_acceptance_rate=0.5, retry_after_steps=10)
    engine = make_engine(speculative_config=rule)
    engine.proposer = ForcedProposer(engine, truth, num_right=0)
    engine.proposer.config = rule
    _, tokens = states_by_length(engine, prompts[1], max_tokens)
    assert tokens == truth
    # rate 0.5 -> 0.25 (one draft), then one draft every 10 steps (each rejected)
    drafts = engine.stats().num_spec_drafts
    assert 1 < drafts <= 1 + max_tokens // 10, f"{drafts} drafts"


def test_executor_metrics_count_proposals(prompts):
    _, engine = run(prompts[:1], greedy(60), ALWAYS)
    metrics = ExecutorMetrics()
    metrics.record_stats(engine.stats())
    sample = metrics.registry.get_sample_value
    stats, labels = engine.stats(), {"method": "ngram"}
    assert sample("kvgate_executor_spec_accepted_tokens_total", labels) > 0
    assert sample("kvgate_executor_spec_accepted_tokens_total", labels) == (
        stats.num_spec_accepted_tokens
    )
    assert sample("kvgate_executor_spec_proposed_tokens_total", labels) == (
        stats.num_spec_proposed_tokens
    )
    assert sample("kvgate_executor_spec_bonus_tokens_total", labels) == stats.num_spec_bonus_tokens
    assert sample("kvgate_executor_spec_drafts_total", labels) == stats.num_spec_drafts
    ratio = stats.num_spec_accepted_tokens / stats.num_spec_proposed_tokens
    assert sample("kvgate_executor_spec_acceptance_ratio", labels) == pytest.approx(ratio)


def test_engine_config_refuses_a_non_config():
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(model=STORIES_260K, speculative_config={"method": "ngram"})
