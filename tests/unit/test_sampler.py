"""Sampler: masks, penalties and filters checked against direct formulas."""

import math

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_tokens,
    apply_penalties,
)

EOS = 7
# A fixed distribution with distinct probabilities, laid out out of order in the vocab.
PROBS = [0.02, 0.3, 0.05, 0.15, 0.08, 0.2, 0.1, 0.07, 0.03]


def make_batch(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingBatch:
    generators = [None if p.seed is None else Sampler.make_generator(p.seed, "cpu") for p in params]
    return SamplingBatch(
        params=params,
        prompt_token_ids=prompts or [[] for _ in params],
        output_token_ids=outputs or [[] for _ in params],
        generators=generators,
    )


def fixed_logits(num_rows: int) -> torch.Tensor:
    return torch.tensor(PROBS).log().expand(num_rows, -1).contiguous()


def sample_many(params: SamplingParams, num_draws: int = 4000) -> list[int]:
    """num_draws independent draws: one batch of identical rows."""
    torch.manual_seed(0)
    batch = make_batch([params] * num_draws)
    return Sampler([EOS])(fixed_logits(num_draws), batch).token_ids


def kept_by_formula(probs: list[float], params: SamplingParams) -> set[int]:
    """The tokens min_p, then top_k, then top_p keep, computed by hand."""
    probs = [p ** (1 / params.temperature) for p in probs]
    probs = [p / sum(probs) for p in probs]
    kept = [i for i, p in enumerate(probs) if p >= params.min_p * max(probs)]
    kept.sort(key=lambda i: -probs[i])
    if params.top_k:
        kept = kept[: params.top_k]
    mass = sum(probs[i] for i in kept)
    result, mass_before = [], 0.0
    for i in kept:
        if mass_before >= params.top_p:
            break
        result.append(i)
        mass_before += probs[i] / mass
    return set(result)


def run_steps(
    sampler: Sampler, step_logits: torch.Tensor, batch: SamplingBatch, row: int, others: int
) -> list[int]:
    """Sample len(step_logits) steps; `row` sees step_logits, the other rows random logits."""
    tokens = []
    for logits in step_logits:
        batch_logits = torch.randn(1 + others, logits.shape[0]) * 3
        batch_logits[row] = logits
        token_ids = sampler(batch_logits, batch).token_ids
        for output, token_id in zip(batch.output_token_ids, token_ids, strict=True):
            output.append(token_id)
        tokens.append(token_ids[row])
    return tokens


def test_seeded_row_gives_same_tokens_alone_or_in_any_batch() -> None:
    step_logits = torch.randn(20, 64, generator=torch.Generator().manual_seed(1))
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32)
    sampler = Sampler([EOS])
    alone = run_steps(sampler, step_logits, make_batch([target]), row=0, others=0)

    other_params = [
        SamplingParams(temperature=1.3, seed=99),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.1, repetition_penalty=1.2, logprobs=3),
    ]
    for row in (0, 2, 4):
        params = other_params[:row] + [target] + other_params[row:]
        batched = run_steps(sampler, step_logits, make_batch(params), row=row, others=4)
        assert batched == alone, f"seed 1234 at row {row}: expected {alone}, got {batched}"

    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=32)
    different = run_steps(sampler, step_logits, make_batch([other_seed]), row=0, others=0)
    assert different != alone, f"expected another seed to give other tokens, got {alone} twice"
    assert len(set(alone)) > 5, f"expected varied sampled tokens, got {alone}"


def test_top_k_1_and_temperature_0_are_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)) * 4
    expected = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.5),
        SamplingParams(temperature=0.0, seed=5),
        SamplingParams(top_k=1, logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=0),
    ]
    got = Sampler([EOS])(logits, make_batch(params)).token_ids
    assert got == expected, f"expected argmax {expected}, got {got}"

    plain = [SamplingParams(temperature=0.0)] * 6
    got = Sampler([EOS])(logits, make_batch(plain)).token_ids
    assert got == expected, f"fast path: expected argmax {expected}, got {got}"


def test_greedy_rows_mixed_with_sampled_rows_stay_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    got = Sampler([EOS])(logits, make_batch(params)).token_ids
    expected = logits.argmax(dim=-1).tolist()
    assert got[0::2] == expected[0::2], f"expected greedy rows {expected[0::2]}, got {got[0::2]}"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=0.7),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.4),
        SamplingParams(top_k=3),
        SamplingParams(top_k=3, top_p=0.6),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=0.5, min_p=0.05, top_k=5, top_p=0.9),
        SamplingParams(),
    ],
    ids=repr,
)
def test_filters_keep_exactly_the_set_of_the_formula(params: SamplingParams) -> None:
    kept = kept_by_formula(PROBS, params)
    sampled = set(sample_many(params))
    assert sampled == kept, f"expected kept tokens {sorted(kept)}, got {sorted(sampled)}"


def test_sampled_frequencies_follow_tempered_probabilities() -> None:
    params = SamplingParams(temperature=0.8, top_k=4)
    draws = sample_many(params, num_draws=20000)
    tempered = [p ** (1 / 0.8) for p in PROBS]
    kept = sorted(range(len(PROBS)), key=lambda i: -PROBS[i])[:4]
    total = sum(tempered[i] for i in kept)
    for token_id in kept:
        expected = tempered[token_id] / total
        got = draws.count(token_id) / len(draws)
        stddev = math.sqrt(expected * (1 - expected) / len(draws))
        assert abs(got - expected) < 5 * stddev, (
            f"token {token_id}: expected frequency {expected:.4f}, got {got:.4f}"
        )


def test_penalties_match_formulas() -> None:
    vocab_size = 10
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(4)) * 2
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4),
    ]
    prompts = [[1, 2, 2], [1, 2], [9]]
    outputs = [[2, 3, 3, 3], [3], [0, 0, 1]]
    original = logits.clone()
    got = apply_penalties(logits, make_batch(params, prompts, outputs))

    expected = original.clone()
    for row, p in enumerate(params):
        for token_id in range(vocab_size):
            value = original[row, token_id].item()
            if token_id in prompts[row] or token_id in outputs[row]:
                rep = p.repetition_penalty
                value = value / rep if value > 0 else value * rep
            count = outputs[row].count(token_id)
            value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            expected[row, token_id] = value
    assert torch.allclose(got, expected, atol=1e-6), f"expected\n{expected}\ngot\n{got}"
    assert torch.equal(logits, original), "apply_penalties modified its input"


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.5]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5)]
    got = Sampler([EOS])(logits, make_batch(params, prompts=[[1]], outputs=[[]])).token_ids
    assert got == [2], f"expected token 2 once token 1 is penalized, got {got}"


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab_size = 10
    logits = torch.zeros(4, vocab_size)
    logits[:, 5] = 3.0  # stop id
    logits[:, EOS] = 2.0
    logits[:, 1] = 1.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(temperature=0.0, stop_token_ids=[5]),
    ]
    outputs = [[4], [4, 4, 4], [4], []]
    batch = make_batch(params, outputs=outputs)
    got = Sampler([EOS])(logits, batch).token_ids
    assert got == [1, 5, EOS, 5], f"expected [1, 5, {EOS}, 5], got {got}"

    masked = apply_min_tokens(logits, batch, [EOS])
    expected_inf = {(0, 5), (0, EOS), (2, 5)}
    got_inf = {tuple(index) for index in torch.isinf(masked).nonzero().tolist()}
    assert got_inf == expected_inf, f"expected -inf at {expected_inf}, got {got_inf}"


def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 3
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    torch.manual_seed(0)
    out = Sampler([EOS])(logits, make_batch(params, prompts=[[0, 1, 2]] * 3))
    raw = logits.log_softmax(dim=-1)

    assert out.logprobs[1] is None, f"expected no logprobs for row 1, got {out.logprobs[1]}"
    for row, n in ((0, 5), (2, 0)):
        logprobs = out.logprobs[row]
        token_id = out.token_ids[row]
        expected = raw[row, token_id].item()
        assert logprobs.token_id == token_id, f"expected token {token_id}, got {logprobs.token_id}"
        assert logprobs.logprob == pytest.approx(expected, abs=1e-5), (
            f"row {row}: expected logprob {expected}, got {logprobs.logprob}"
        )
        values, ids = raw[row].topk(n)
        expected_top = list(zip(ids.tolist(), values.tolist(), strict=True))
        assert [t for t, _ in logprobs.top] == [t for t, _ in expected_top], (
            f"row {row}: expected top ids {expected_top}, got {logprobs.top}"
        )
        assert [v for _, v in logprobs.top] == pytest.approx([v for _, v in expected_top]), (
            f"row {row}: expected top logprobs {expected_top}, got {logprobs.top}"
        )
        got_values = [v for _, v in logprobs.top]
        assert got_values == sorted(got_values, reverse=True), f"top not sorted: {logprobs.top}"


def test_sampler_leaves_input_logits_alone() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(6))
    original = logits.clone()
    params = [
        SamplingParams(min_tokens=2, repetition_penalty=1.4, top_p=0.8),
        SamplingParams(temperature=0.0, min_tokens=2),
    ]
    Sampler([1, 2])(logits, make_batch(params, prompts=[[3, 4], [5]]))
    assert torch.equal(logits, original), "the sampler modified the logits it was given"


def test_bfloat16_logits_and_empty_batch_are_accepted() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    params = [SamplingParams(min_tokens=1, frequency_penalty=0.5, logprobs=1)] * 2
    out = Sampler([1])(logits, make_batch(params, outputs=[[3], []]))
    assert len(out.token_ids) == 2, f"expected 2 tokens, got {out.token_ids}"
    assert out.token_ids[1] != 1, f"expected EOS masked before min_tokens, got {out.token_ids}"

    empty = Sampler([1])(torch.zeros(0, 20), make_batch([]))
    assert empty.token_ids == [], f"expected no tokens for an empty batch, got {empty.token_ids}"
