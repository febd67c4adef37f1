"""The engine when things go wrong around it: a request resumed from an earlier run's tokens
(its executor died), and a model step that raises for one request."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams
from engine.model_runner import ModelRunner
from tests.helpers import STORIES_260K, greedy, make_engine, run_to_completion

POISON_TOKEN = 511  # a prompt holding it makes the test's forward pass raise


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return AutoTokenizer.from_pretrained(STORIES_260K)("Once upon a time").input_ids


@pytest.mark.parametrize(
    "params",
    [
        greedy(40),
        SamplingParams(max_tokens=40, temperature=0.8, seed=77, ignore_eos=True),
        SamplingParams(
            max_tokens=40, temperature=0.8, seed=78, ignore_eos=True, frequency_penalty=0.7,
            presence_penalty=0.4, min_tokens=30,
        ),
    ],
    ids=["greedy", "seeded", "seeded-penalized"],
)  # fmt: skip
def test_a_resumed_request_continues_its_undisturbed_run(prompt, params):
    """Resumed after 15 tokens, the request produces the rest of the undisturbed output: its
    seeded generator goes on past the draws already made, and the penalties and min_tokens
    count the resumed tokens as output."""
    undisturbed = make_engine()
    undisturbed.add_request("r", prompt, params)
    whole = run_to_completion(undisturbed)["r"]
    assert len(whole) == 40
    resumed = make_engine()
    resumed.add_request("r", prompt, params, resume_token_ids=whole[:15])
    rest = run_to_completion(resumed)["r"]
    assert whole[:15] + rest == whole, f"expected {whole[15:]}\ngot      {rest}"


class PoisonedRunner:
    """Makes the engine's forward pass raise whenever its batch holds a poisoned prompt."""

    def __init__(self, runner: ModelRunner) -> None:
        self.execute_cleanly = runner.execute
        runner.execute = self.execute

    def execute(self, out):
        if any(POISON_TOKEN in s.request.prompt_token_ids for s in out.scheduled):
            raise RuntimeError("poisoned forward")
        return self.execute_cleanly(out)


def test_a_step_that_raises_fails_only_the_request_that_makes_it_raise(prompt):
    params = greedy(16)
    clean = make_engine()
    for index in range(3):
        clean.add_request(f"ok-{index}", prompt + [index + 3], params)
    expected = run_to_completion(clean)
    engine = make_engine()
    PoisonedRunner(engine.runner)
    for index in range(3):
        engine.add_request(f"ok-{index}", prompt + [index + 3], params)
    engine.add_request("poison", prompt + [POISON_TOKEN], params)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    tokens = {}
    for output in outputs:
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    failed = [o for o in outputs if o.finish_reason == FinishReason.ERROR]
    assert [o.request_id for o in failed] == ["poison"], failed
    assert "poisoned forward" in failed[0].error_message, failed[0].error_message
    assert {rid: t for rid, t in tokens.items() if rid != "poison"} == expected
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, f"blocks still held: {stats}"
