"""n-gram speculative decoding through the whole stack, switched on as `make run` does it
(KVGATE_SPECULATIVE_CONFIG in the executor's environment): the same tokens, texts and finish
reasons as a stack without it, with proposals accepted (the executor's metrics)."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from client.api import KvgateClient
from tests.integration.conftest import generate, scrape

SPECULATIVE_CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                 "min_acceptance_rate": 0.0})  # fmt: skip
PROMPTS = ["The dog ran and ran and ran and ran and", "One, two, three, one, two, three, one,"]


def accepted_tokens(metrics_text: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "kvgate_executor_spec_accepted_tokens_total":
                assert sample.labels == {"method": "ngram"}, sample
                return sample.value
    raise AssertionError("kvgate_executor_spec_accepted_tokens_total not in the metrics")


def completions(address: str) -> list[tuple]:
    """Greedy and seeded completions, one ended by a stop string, and a two-turn chat."""
    results = []
    for prompt in PROMPTS:
        for params in ({"max_tokens": 60, "ignore_eos": True},
                       {"max_tokens": 60, "temperature": 0.8, "seed": 7},
                       {"max_tokens": 60, "stop": ["big"]}):  # fmt: skip
            done = generate(address, prompt, **params)
            results.append((done.token_ids, done.text, done.finish_reason))
    with KvgateClient(address, timeout_s=60) as client:
        chat = client.chat()
        for content in ("Tell me about a dog that ran and ran.", "And then?"):
            reply = chat.ask(content, max_tokens=30, temperature=0.0)
            results.append((reply.token_ids, reply.usage.cached_prompt_tokens))
        chat.close()
    return results


def test_stack_with_speculation_answers_as_without(stack_factory):
    speculating = stack_factory(executor_env={"KVGATE_SPECULATIVE_CONFIG": SPECULATIVE_CONFIG})
    plain = stack_factory()
    got, want = completions(speculating.address), completions(plain.address)
    for i, (got_one, want_one) in enumerate(zip(got, want, strict=True)):
        assert got_one == want_one, f"completion {i}: {got_one} vs {want_one}"
    stopped = [want[2], want[5]]  # the completions given the stop string
    assert any(reason == "stop" and "big" not in text for _, text, reason in stopped), stopped
    assert accepted_tokens(scrape(speculating, "executor-0")) > 0
    assert "kvgate_executor_spec_accepted_tokens_total{" not in scrape(plain, "executor-0")
