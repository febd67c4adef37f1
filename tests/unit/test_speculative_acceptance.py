"""Speculative decoding's acceptance checks beyond tests/unit/test_speculative.py: unseeded
sampled output has the distribution of a run without proposals (a chi-square test), greedy
output is unchanged on a random Llama of realistic shape and on SmolLM2 quantized, and a
thousand mixed requests give back every block."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2_contingency
from transformers import AutoTokenizer

from bench.decoding import quote_prompt
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from deploy.models import default_gguf_path
from engine.engine import Engine
from engine.speculative_config import SpeculativeConfig
from executor.metrics import ExecutorMetrics
from tests.helpers import (
    STORIES_260K,
    greedy,
    greedy_tokens,
    make_engine,
    one_torch_thread,
    run_to_completion,
    save_random_llama,
)

# Every request proposes whatever the batch: the rule is tested in test_speculative.py.
EVERY_REQUEST = SpeculativeConfig(min_acceptance_rate=0.0, disable_by_batch_size=1 << 20)
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside. "
    "One day, Lily saw a big red ball. "
)
# The story three times and the start of a fourth: proposals copy it, mostly accepted.
RETOLD = STORY * 3 + "Once upon a time, there was a little"
REPEATING = "The dog ran and ran and ran and ran and ran and"
# A chi-square p-value below this says the two samples come from different distributions.
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES_260K)


# ---- the distribution of sampled output -----------------------------------------------------


def sampled_positions(prompt: list[int], params: SamplingParams, spec, torch_seed: int, n: int):
    """Each request's generated tokens (`n` unseeded requests; the global generator seeded
    with `torch_seed`), and the engine."""
    torch.manual_seed(torch_seed)
    engine = make_engine(speculative_config=spec, max_num_seqs=256, kv_cache_gib=0.05)
    for i in range(n):
        engine.add_request(f"s{i}", prompt, params)
    return list(run_to_completion(engine).values()), engine


def chi_square_p(first: list[int], second: list[int]) -> float:
    """The p-value of a chi-square test that two samples of tokens share a distribution;
    tokens seen fewer than 10 times in both together count as one category."""
    counts = [Counter(first), Counter(second)]
    total = counts[0] + counts[1]
    common = sorted(t for t, c in total.items() if c >= 10)
    table = [[c[t] for t in common] + [sum(c.values()) - sum(c[t] for t in common)] for c in counts]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    return chi2_contingency(table).pvalue


def test_sampled_distribution_with_proposals_is_the_targets(tokenizer):
    """1200 unseeded continuations at temperature 1 with and without proposals (different
    global seeds): each position proposals cover has the same token distribution; a run at
    temperature 0.7 does not, which shows the test can tell."""
    prompt, n = tokenizer(RETOLD).input_ids, 1200
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    plain, _ = sampled_positions(prompt, params, None, torch_seed=1, n=n)
    spec, engine = sampled_positions(prompt, params, EVERY_REQUEST, torch_seed=2, n=n)
    stats = engine.stats()
    assert stats.num_spec_drafts >= n // 4, stats
    assert stats.num_spec_accepted_tokens >= n // 4, stats
    assert stats.num_spec_proposed_tokens > stats.num_spec_accepted_tokens, stats
    for position in range(1, 4):  # the first token comes from the prompt's step, unproposed
        p = chi_square_p([t[position] for t in plain], [t[position] for t in spec])
        assert p > SIGNIFICANCE, f"position {position}: p = {p:.2e}"
    cooler = SamplingParams(max_tokens=4, temperature=0.7, ignore_eos=True)
    cool, _ = sampled_positions(prompt, cooler, None, torch_seed=3, n=n)
    p = chi_square_p([t[1] for t in plain], [t[1] for t in cool])
    assert p < SIGNIFICANCE, f"temperature 1 vs 0.7 told apart only with p = {p:.2e}"


def draft_config(model) -> SpeculativeConfig:
    """A draft model proposing 4 tokens for every request, whatever the batch."""
    spec = SpeculativeConfig.from_json(
        json.dumps({"model": str(model), "num_speculative_tokens": 4})
    )
    return replace(spec, min_acceptance_rate=0.0, disable_by_batch_size=1 << 20)


def cooled_draft(folder) -> str:
    """stories260K with its final norm scaled by 0.7: the same tokenizer, flatter logits, so
    its q differs from the target's p and some of its sampled proposals are rejected."""
    shutil.copytree(STORIES_260K, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 0.7
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_a_draft_models_sampled_proposals_keep_the_targets_distribution(tokenizer, tmp_path):
    """1200 unseeded continuations at temperature 1 drafted by a model whose q is not the
    target's p: the draft samples each proposal from q, the sampler keeps it with probability
    min(1, p / q) or draws from max(0, p - q); proposals are accepted and rejected, and each
    position has the distribution of a run without proposals."""
    prompt, n = tokenizer(RETOLD).input_ids, 1200
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    plain, _ = sampled_positions(prompt, params, None, torch_seed=1, n=n)
    spec = draft_config(cooled_draft(tmp_path / "draft"))
    drafted, engine = sampled_positions(prompt, params, spec, torch_seed=2, n=n)
    stats = engine.stats()
    assert stats.num_spec_accepted_tokens >= n // 4, stats
    assert stats.num_spec_proposed_tokens > stats.num_spec_accepted_tokens, stats
    for position in range(1, 4):
        p = chi_square_p([t[position] for t in plain], [t[position] for t in drafted])
        assert p > SIGNIFICANCE, f"position {position}: p = {p:.2e}"


def test_a_draft_that_is_the_target_has_its_sampled_proposals_all_but_always_accepted(tokenizer):
    """Drafting for itself at temperature 1, unseeded, the draft's q is the target's p (up to
    rounding), so min(1, p / q) keeps nearly every proposal; proposing the draft's argmax
    instead would keep one only as often as the target samples that token."""
    prompt = tokenizer(STORY).input_ids
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    _, engine = sampled_positions(prompt, params, draft_config(STORIES_260K), torch_seed=4, n=16)
    stats = engine.stats()
    assert stats.num_spec_proposed_tokens >= 16 * 4, stats
    assert stats.num_spec_accepted_tokens >= 0.95 * stats.num_spec_proposed_tokens, stats


# ---- greedy identity on other models ---------------------------------------------------------


def greedy_twice(model: str, prompt: list[int], max_tokens: int, **engine_fields):
    """Greedy tokens without and with proposals, and the speculative engine's stats."""
    results = []
    for spec in (None, EVERY_REQUEST):
        engine = make_engine(model, speculative_config=spec, **engine_fields)
        results.extend(greedy_tokens(engine, [prompt], max_tokens))
    return results, engine.stats()


def test_random_llama_greedy_identical_and_accepted(tmp_path):
    """A seeded random Llama of realistic shape (64-wide heads, grouped queries, untied head)
    on a prompt that repeats a phrase: the proposals copy it."""
    save_random_llama(tmp_path, vocab_size=2048, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    prompt = [11, 402, 93, 7, 1500, 64] * 8
    (plain, spec), stats = greedy_twice(str(tmp_path), prompt, 48, block_size=4)
    assert spec == plain
    assert stats.num_spec_accepted_tokens > 0, stats
    assert stats.num_spec_proposed_tokens > stats.num_spec_accepted_tokens, stats  # rejections too


# The first two paragraphs of the quoting benchmark's text (155 tokens on SmolLM2)
QUOTE_TOKENS = 200


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_smollm2_quantized_greedy_identical_and_accepted(quantization):
    """SmolLM2 quoting its prompt, weights quantized by the engine (the GGUF as loaded is
    test_speculative.py's test_smollm2_quoting_greedy_identical_and_accepted)."""
    path = default_gguf_path()
    assert path.is_file(), f"{path} is missing: `make setup` fetches it (deploy/fetch_model.py)"
    prompt = quote_prompt(ModelText(str(path)), QUOTE_TOKENS)
    with one_torch_thread():
        (plain, spec), stats = greedy_twice(
            path, prompt, 24, kv_cache_gib=0.05, quantization=quantization
        )
    assert spec == plain
    assert stats.num_spec_accepted_tokens >= 12, stats  # the model copies its prompt


# ---- a thousand requests give every block back ----------------------------------------------


def mixed_requests(tokenizer, n: int) -> list[tuple[str, list[int], SamplingParams]]:
    """`n` short requests: greedy, seeded and unseeded sampling, and greedy ones with stop
    ids the story's proposals carry (a proposal ends before its stop; the target stops)."""
    prompts = [tokenizer(t).input_ids for t in (RETOLD, REPEATING, STORY * 2, "Lily and Ben")]
    stops = [tokenizer(w).input_ids[-1] for w in (" ball", " Lily", " play")]
    requests = []
    for i in range(n):
        max_tokens = 6 + i % 11
        params = [
            greedy(max_tokens),
            SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i),
            SamplingParams(max_tokens=max_tokens, temperature=1.0),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stops),
        ][i % 4]
        requests.append((f"m{i}", prompts[i % len(prompts)], params))
    return requests


def run_aborting(engine: Engine, requests, aborted: set[str]):
    """Each request's tokens and finish reasons (one a step); the `aborted` ones are aborted
    after their first output."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    got: dict[str, tuple[list[int], list]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, reasons = got.setdefault(out.request_id, ([], []))
            tokens += out.new_token_ids
            reasons.append(out.finish_reason)
            if out.request_id in aborted and out.finish_reason is None:
                engine.abort(out.request_id)
    return got


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_thousand_mixed_requests_free_every_block(tokenizer, method):
    """1000 requests, every tenth aborted mid-way: the target's cache (and the draft's) ends
    with every block free; the requests that ran to the end match a run without proposals."""
    spec = EVERY_REQUEST
    if method == "draft_model":
        spec = replace(EVERY_REQUEST, method=method, model=str(STORIES_260K))
    requests = mixed_requests(tokenizer, 1000)
    aborted = {request_id for request_id, _, _ in requests[::10]}
    fields = {"max_num_seqs": 128, "kv_cache_gib": 0.05}
    plain = run_aborting(make_engine(**fields), requests, aborted)
    engine = make_engine(speculative_config=spec, **fields)
    got = run_aborting(engine, requests, aborted)
    stats = engine.stats()
    assert stats.num_spec_accepted_tokens > 0, stats
    assert stats.num_free_blocks + stats.num_session_blocks == stats.num_total_blocks, stats
    assert stats.num_running == stats.num_waiting == 0
    if method == "draft_model":
        engine.step()  # a step with nothing running forgets the finished requests' shadows
        draft_cache = engine.proposer.kv_cache
        assert draft_cache.num_free_blocks == draft_cache.num_blocks
    reasons = Counter(got[request_id][1][-1] for request_id, _, _ in requests)
    assert reasons["stop"] > 0 and reasons["length"] > 0, reasons
    assert reasons[None] > len(aborted) // 2, reasons  # aborted before they ended
    for request_id, _, params in requests:
        if request_id in aborted or params.seed is None and params.temperature > 0:
            continue
        (tokens, reasons), (want, want_reasons) = got[request_id], plain[request_id]
        assert (tokens, reasons[-1]) == (want, want_reasons[-1]), request_id


# ---- the mean accepted length ---------------------------------------------------------------


def test_mean_accepted_length_stat_and_metric(tokenizer):
    engine = make_engine(speculative_config=EVERY_REQUEST)
    assert engine.stats().spec_mean_accepted_length == 0.0  # no draft yet
    engine.add_request("r", tokenizer(RETOLD).input_ids, greedy(40))
    run_to_completion(engine)
    stats = engine.stats()
    length = 1 + stats.num_spec_accepted_tokens / stats.num_spec_drafts
    assert stats.spec_mean_accepted_length == pytest.approx(length)
    assert length > 2, stats  # the retold story is copied several tokens a step
    metrics = ExecutorMetrics()
    metrics.record_stats(stats)
    sample = metrics.registry.get_sample_value
    labels = {"method": "ngram"}
    assert sample("kvgate_executor_spec_mean_accepted_length", labels) == pytest.approx(length)
