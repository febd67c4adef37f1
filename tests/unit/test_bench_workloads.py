"""The benchmark's workload generators, with a word-counting stand-in for the tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.workloads import (
    ChatJob,
    GenerateJob,
    WorkloadConfig,
    build_jobs,
    random_text,
    vocab_words,
)


def count_tokens(text: str) -> int:
    """One token per character pair of each word, plus a BOS token: words are uneven."""
    return 1 + sum((len(word) + 1) // 2 for word in text.split())


def test_random_text_hits_the_requested_token_count():
    rng = np.random.default_rng(0)
    for wanted in (5, 32, 128, 300):
        found = count_tokens(random_text(wanted, rng, count_tokens))
        # within one word (at most 4 tokens with this counter) of the length asked for
        assert abs(found - wanted) <= 4, f"asked {wanted} tokens, got {found}"


def test_fixed_lengths_without_range_ratio():
    config = WorkloadConfig("random", num_requests=6, input_len=40, output_len=9)
    jobs = build_jobs(config, count_tokens)
    assert len(jobs) == 6 and all(isinstance(job, GenerateJob) for job in jobs)
    assert {job.output_len for job in jobs} == {9}
    assert all(abs(count_tokens(job.prompt) - 40) <= 4 for job in jobs)


def test_range_ratio_spreads_lengths_within_bounds():
    config = WorkloadConfig("random", 200, input_len=20, output_len=100, range_ratio=0.5)
    output_lens = [job.output_len for job in build_jobs(config, count_tokens)]
    assert min(output_lens) >= 50 and max(output_lens) <= 150
    assert len(set(output_lens)) > 20, "range_ratio 0.5 should give many different lengths"
    assert np.mean(output_lens) == pytest.approx(100, abs=10)


def test_same_seed_same_prompts():
    config = WorkloadConfig("random", 4, input_len=16, output_len=4, seed=3)
    assert build_jobs(config, count_tokens) == build_jobs(config, count_tokens)
    other = WorkloadConfig("random", 4, input_len=16, output_len=4, seed=4)
    assert build_jobs(config, count_tokens) != build_jobs(other, count_tokens)


def test_shared_prefix_has_n_prefixes_of_m_suffixes():
    config = WorkloadConfig(
        "shared-prefix", 12, input_len=8, output_len=4, prefix_len=30, num_prefixes=3
    )
    jobs = build_jobs(config, count_tokens)
    prefix_words = len(random_text(30, np.random.default_rng(9), count_tokens).split())
    heads: dict[str, int] = {}
    for job in jobs:
        head = " ".join(job.prompt.split()[: prefix_words // 2])
        heads[head] = heads.get(head, 0) + 1
    assert sorted(heads.values()) == [4, 4, 4], f"expected 3 prefixes x 4 suffixes, got {heads}"
    assert len({job.prompt for job in jobs}) == 12, "every suffix differs"


def test_chat_sessions_have_k_turns():
    config = WorkloadConfig("chat", 6, input_len=10, output_len=5, num_turns=3)
    jobs = build_jobs(config, count_tokens)
    assert len(jobs) == 2 and all(isinstance(job, ChatJob) for job in jobs)
    for job in jobs:
        assert len(job.turns) == 3 and job.output_lens == [5, 5, 5]
        # a turn is counted without the BOS token that only a whole prompt gets
        assert all(abs(count_tokens(turn) - 1 - 10) <= 4 for turn in job.turns)


def test_invalid_workloads_name_the_flag():
    with pytest.raises(ValueError, match="--num-turns"):
        WorkloadConfig("chat", 7, num_turns=3)
    with pytest.raises(ValueError, match="--range-ratio"):
        WorkloadConfig("random", 4, range_ratio=1.0)
    with pytest.raises(ValueError, match="--input-len"):
        WorkloadConfig("random", 4, input_len=0)


def test_vocab_words_are_the_whole_words_of_the_tokenizer(tmp_path):
    vocab = {"<s>": 0, "\u2581the": 1, "w5": 2, "\u0120cat": 3, ",": 4, "the": 5}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    assert vocab_words(tmp_path) == ["the", "w5", "cat"]


def test_prompts_are_drawn_from_the_given_words():
    config = WorkloadConfig("random", 3, input_len=12, output_len=2)
    jobs = build_jobs(config, count_tokens, words=["w7", "w9"])
    assert {word for job in jobs for word in job.prompt.split()} <= {"w7", "w9"}
