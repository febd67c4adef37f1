"""Structured output and logit masks in the engine, on stories260K: the engine's allowed tokens
are llguidance's own mask, sampled outputs match their constraint, and the masks survive
resumption, preemption and compilation off the step loop."""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoTokenizer

from common.constraints import Constraint, ConstraintError, ConstraintKind, llguidance_grammar
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParamError, SamplingParams
from engine.engine import Engine
from engine.sampler import apply_logit_masks
from engine.structured import StructuredOutput
from tests.helpers import STORIES_260K, greedy, make_engine, run_to_completion

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
COLORS = {
    "type": "object",
    "properties": {
        "colors": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["colors"],
    "additionalProperties": False,
}
# Every schema bounds its output (maxLength, maxItems, enums, integer ranges): the longest
# JSON any of them accepts, each string character written as a 6-character \u escape, is
# under 100 characters, so within SAMPLED_MAX_TOKENS (a token is at least one byte) an
# output always finishes with `stop`.
SCHEMAS = [
    PERSON,
    COLORS,
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 4},
    {"enum": ["cat", "dog", 3, None]},
    {
        "type": "object",
        "properties": {"a": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}, "b": COLORS},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
]
REGEX = r"[a-z]{2,5}( [a-z]{2,5}){1,3}\."
CHOICES = ("yes", "no", "maybe so")
SAMPLED_MAX_TOKENS = 120
SEEDS = range(50)  # sampled outputs checked per constraint, at temperature 1.0
LARK = 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,3}/'
# Sampler paths the sampled runs rotate through (greedy, top-k/p, min-p, penalties).
SAMPLER_PATHS = [
    {"temperature": 1.0},
    {"temperature": 1.0, "top_k": 5, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 1.0, "repetition_penalty": 1.3, "presence_penalty": 0.5},
    {"temperature": 1.0, "frequency_penalty": 1.0, "logprobs": 3},
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES_260K)


@pytest.fixture(scope="module", autouse=True)
def one_model_thread() -> Iterator[None]:
    """One torch thread, as an executor beside the rest of a stack runs: on a busy 2-core
    machine two threads wait on each other at every parallel region (the 250 requests of
    the schemas-by-seeds test took 55 s with two, 3 s with one, at a load average of 20)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def sampled(
    constraint: Constraint, seed: int, max_tokens: int = SAMPLED_MAX_TOKENS, **kw
) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    return SamplingParams(max_tokens=max_tokens, seed=seed, constraint=constraint, **kw)


def schema(value: dict) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(value))


def run(engine: Engine, requests: dict[str, SamplingParams], prompt: list[int]) -> dict:
    """Runs the requests together; per id (tokens, finish reason, error message)."""
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, tuple[list[int], FinishReason | None, str]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens = results.get(out.request_id, ([], None, ""))[0] + out.new_token_ids
            results[out.request_id] = (tokens, out.finish_reason, out.error_message)
    return results


class RecordingSampler:
    """The engine's sampler, recording each row's allowed tokens (its finite masked logits)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.allowed: dict[int, list[torch.Tensor]] = {}  # by id() of the row's params

    def __call__(self, logits, batch):
        finite = torch.isfinite(apply_logit_masks(logits.float(), batch))
        for row, params in enumerate(batch.params):
            self.allowed.setdefault(id(params), []).append(finite[row].clone())
        return self.sampler(logits, batch)

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)


def llguidance_allowed(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    bits = matcher.compute_bitmask()
    words = torch.frombuffer(bytearray(bits), dtype=torch.int32)
    unpacked = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return unpacked.flatten()[:vocab_size].bool()


@pytest.mark.parametrize(
    "constraint",
    [
        schema(PERSON),
        schema(COLORS),
        Constraint(ConstraintKind.JSON_OBJECT),
        Constraint(ConstraintKind.REGEX, REGEX),
        Constraint(ConstraintKind.CHOICE, choices=CHOICES),
        Constraint(ConstraintKind.GRAMMAR, LARK),
    ],
    ids=lambda c: c.kind.value,
)
def test_allowed_tokens_equal_llguidance_mask_at_every_step(engine, tokenizer, constraint):
    prompt = tokenizer("Once upon a time").input_ids
    assert_masks_are_llguidance_masks(engine, tokenizer, constraint, prompt)


@pytest.fixture(scope="module")
def smollm2_engine(gguf: Path) -> Iterator[Engine]:
    """One SmolLM2 engine for the module's constraints (each test's requests finish)."""
    engine = make_engine(gguf, kv_cache_gib=0.05)
    yield engine
    engine.close()


@pytest.mark.parametrize(
    "constraint",
    [schema(PERSON), Constraint(ConstraintKind.REGEX, REGEX)],
    ids=lambda c: c.kind.value,
)
def test_allowed_tokens_equal_llguidance_mask_on_smollm2(
    smollm2_engine, smollm2_tokenizer, constraint
):
    prompt = smollm2_tokenizer("Describe a person as JSON:").input_ids
    assert_masks_are_llguidance_masks(
        smollm2_engine, smollm2_tokenizer, constraint, prompt, max_tokens=20
    )


def assert_masks_are_llguidance_masks(
    engine: Engine, hf_tokenizer, constraint: Constraint, prompt: list[int], max_tokens: int = 40
) -> None:
    """Samples three seeds at temperature 1.0 and holds the engine's allowed tokens at each
    step to those of a matcher llguidance builds directly from `hf_tokenizer`."""
    vocab_size = engine.model_config.vocab_size
    eos = list(engine.model_config.eos_token_ids)
    direct_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    try:
        params = {f"s{s}": sampled(constraint, s, max_tokens=max_tokens) for s in range(3)}
        results = run(engine, params, prompt)
    finally:
        engine.sampler = recorder.sampler
    for request_id, p in params.items():
        tokens, _, error = results[request_id]
        assert not error, f"{request_id} failed: {error}"
        matcher = llguidance.LLMatcher(direct_tokenizer, llguidance_grammar(constraint))
        steps = recorder.allowed[id(p)]
        assert len(steps) == len(tokens), f"{request_id}: {len(steps)} masks, {len(tokens)} tokens"
        for step, (engine_allowed, token) in enumerate(zip(steps, tokens, strict=True)):
            expected = llguidance_allowed(matcher, vocab_size)
            diff = (engine_allowed != expected).nonzero().flatten().tolist()
            assert not diff, f"{request_id} step {step}: masks differ at token ids {diff[:10]}"
            assert engine_allowed[token], f"{request_id} step {step}: sampled forbidden {token}"
            if token not in eos:
                assert matcher.consume_token(token), matcher.get_error()


def decoded(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_schemas_by_seeds_all_validate_on_every_sampler_path(engine, tokenizer):
    params = {
        f"{i}-{seed}": sampled(schema(value), seed, **SAMPLER_PATHS[seed % len(SAMPLER_PATHS)])
        for i, value in enumerate(SCHEMAS)
        for seed in SEEDS
    }
    results = run(engine, params, tokenizer("Once upon a time").input_ids)
    for request_id, (tokens, reason, error) in results.items():
        text = decoded(tokenizer, tokens)
        assert reason == FinishReason.STOP, f"{request_id}: {reason} {error!r} after {text!r}"
        value = json.loads(text)
        jsonschema.validate(value, SCHEMAS[int(request_id.split("-")[0])])


def test_regex_choice_and_grammar_outputs_match(engine, tokenizer):
    lark = re.compile(r"\(\d{1,3}(\+\d{1,3})?\)")
    kinds = {
        "regex": (Constraint(ConstraintKind.REGEX, REGEX), re.compile(REGEX).fullmatch),
        "choice": (Constraint(ConstraintKind.CHOICE, choices=CHOICES), CHOICES.__contains__),
        "grammar": (Constraint(ConstraintKind.GRAMMAR, LARK), lark.fullmatch),
    }
    params = {f"{k}-{s}": sampled(c, s) for k, (c, _) in kinds.items() for s in SEEDS}
    results = run(engine, params, tokenizer("Once upon a time").input_ids)
    for request_id, (tokens, reason, error) in results.items():
        text = decoded(tokenizer, tokens)
        assert reason == FinishReason.STOP, f"{request_id}: {reason} {error!r} after {text!r}"
        assert kinds[request_id.split("-")[0]][1](text), f"{request_id}: {text!r} does not match"


def test_max_tokens_inside_an_object_finishes_with_length(engine, tokenizer):
    results = run(engine, {"r": sampled(schema(PERSON), 0, max_tokens=4)}, [1])
    tokens, reason, _ = results["r"]
    assert reason == FinishReason.LENGTH, f"expected length, got {reason}"
    assert len(tokens) == 4 and decoded(tokenizer, tokens).startswith('{"')


def test_resumed_request_replays_its_tokens_into_the_matcher(engine, tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    params = sampled(schema(PERSON), seed=7)
    whole = run(engine, {"whole": params}, prompt)["whole"][0]
    engine.add_request("resumed", prompt, params, resume_token_ids=whole[:5])
    rest = run_to_completion(engine)["resumed"]
    assert whole[:5] + rest == whole, f"resumed {whole[:5]} + {rest}, undisturbed {whole}"


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_constrained_requests_still_validate(tokenizer, preemption_mode):
    tight = make_engine(
        block_size=4, num_gpu_blocks=30, swap_space_gib=0.01, preemption_mode=preemption_mode
    )
    free = make_engine(block_size=4)
    params = {f"p{i}": sampled(schema(PERSON), seed=i, max_tokens=60) for i in range(6)}
    prompt = tokenizer("Once upon a time there was a little girl").input_ids
    expected, got = run(free, params, prompt), run(tight, params, prompt)
    stats = tight.stats()
    assert stats.num_preemptions > 0, "the tight cache was expected to preempt"
    assert (stats.num_swapped_out_blocks > 0) == (preemption_mode == "swap"), stats
    assert got == expected, "preempted constrained requests produced different tokens"
    for tokens, _, _ in got.values():
        jsonschema.validate(json.loads(decoded(tokenizer, tokens)), PERSON)


def test_compiling_request_does_not_hold_back_other_requests(tokenizer):
    engine = make_engine()
    tokenizer_loaded = threading.Event()
    proceed = threading.Event()
    real = engine.structured

    def slow_load():
        tokenizer_loaded.set()
        proceed.wait()
        return real.compiler.tokenizer

    engine.structured = StructuredOutput(slow_load, engine.model_config.vocab_size)
    prompt = tokenizer("Once upon a time").input_ids
    engine.add_request("constrained", prompt, sampled(schema(PERSON), 0))
    engine.add_request("free", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert tokenizer_loaded.wait(30), "the compile never started"
    free: list[int] = []
    while len(free) < 8:
        outputs = engine.step()
        assert all(o.request_id == "free" for o in outputs), f"constrained ran: {outputs}"
        free += [t for o in outputs for t in o.new_token_ids]
    assert engine.structured.num_compiling == 1
    proceed.set()
    tokens = run_to_completion(engine)["constrained"]
    jsonschema.validate(json.loads(decoded(tokenizer, tokens)), PERSON)
    engine.close()


def test_logprobs_describe_the_masked_distribution(engine, tokenizer):
    choice = Constraint(ConstraintKind.CHOICE, choices=CHOICES)
    engine.add_request(
        "lp", tokenizer("Once upon a time").input_ids, sampled(choice, 1, logprobs=20)
    )
    first = run_to_first_output(engine).logprobs[0]
    direct = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer, n_vocab=512), llguidance_grammar(choice)
    )
    allowed = set(llguidance_allowed(direct, 512).nonzero().flatten().tolist())
    finite = [(t, lp) for t, lp in first.top if lp > -math.inf]
    assert {t for t, _ in finite} <= allowed, f"{first.top} outside the mask {sorted(allowed)}"
    assert len(finite) == len(allowed) < 20, f"{len(finite)} finite of {len(allowed)} allowed"
    mass = sum(math.exp(lp) for _, lp in finite)
    assert mass == pytest.approx(1.0, abs=1e-4), f"masked probabilities sum to {mass}"
    run_to_completion(engine)


def run_to_first_output(engine: Engine):
    while engine.has_unfinished():
        outputs = engine.step()
        if outputs:
            return outputs[0]
    raise AssertionError("the engine finished without output")


def test_logit_bias_and_allowed_token_ids(engine, tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    params = {
        "bias": greedy(6, logit_bias={77: 100.0}),
        "allowed": SamplingParams(allowed_token_ids=[10, 20, 30], temperature=1.0, seed=3,
                                  max_tokens=20, ignore_eos=True),
        "banned": greedy(6, logit_bias={t: -100.0 for t in range(100, 512)}),
    }  # fmt: skip
    results = run(engine, params, prompt)
    assert results["bias"][0] == [77] * 6, results["bias"]
    assert set(results["allowed"][0]) <= {10, 20, 30}, results["allowed"]
    assert all(t < 100 for t in results["banned"][0]), results["banned"]


def test_no_allowed_token_finishes_the_request_alone_with_an_error(engine, tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    choice = Constraint(ConstraintKind.CHOICE, choices=("yes",))
    yes = llguidance.hf.from_tokenizer(tokenizer, n_vocab=512).tokenize_str("yes")
    params = {
        "blocked": sampled(choice, 0, allowed_token_ids=[t for t in range(3, 512) if t != yes[0]]),
        "fine": greedy(5),
    }
    results = run(engine, params, prompt)
    assert results["blocked"][1] == FinishReason.ERROR
    assert "no token is allowed" in results["blocked"][2], results["blocked"]
    assert len(results["fine"][0]) == 5, results["fine"]


def test_a_constraint_complete_before_min_tokens_finishes_with_stop(engine, tokenizer):
    """The grammar's end comes before min_tokens: only end-of-sequence is allowed and
    min_tokens masks it; the request ends there, complete, as `stop`."""
    prompt = tokenizer("Once upon a time").input_ids
    digit = Constraint(ConstraintKind.REGEX, "0")
    results = run(engine, {"short": sampled(digit, 0, min_tokens=5)}, prompt)
    tokens, reason, error = results["short"]
    assert (reason, error) == (FinishReason.STOP, ""), results["short"]
    assert tokenizer.decode(tokens) == "0", tokens


def test_a_grammar_that_does_not_compile_finishes_with_an_error_naming_the_field(engine):
    results = run(engine, {"bad": sampled(Constraint(ConstraintKind.REGEX, "[a-"), 0)}, [1])
    _, reason, error = results["bad"]
    assert reason == FinishReason.ERROR and error.startswith("params.regex"), results["bad"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {5: math.nan}}, "logit_bias[5]"),
        ({"logit_bias": {5: 101.0}}, "logit_bias[5]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"constraint": schema(PERSON), "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_sampling_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(SamplingParamError) as refused:
        SamplingParams(**kwargs)
    assert refused.value.field == field, str(refused.value)


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    for kwargs in ({"logit_bias": {512: 1.0}}, {"allowed_token_ids": [3, 600]}):
        with pytest.raises(ValueError, match="vocabulary has 512"):
            engine.add_request("x", [1, 2], SamplingParams(**kwargs))


def test_bad_constraints_are_refused_naming_the_kind():
    with pytest.raises(ConstraintError, match="^choice "):
        Constraint(ConstraintKind.CHOICE, choices=("a", ""))
    with pytest.raises(ConstraintError, match="^json_schema is not valid JSON"):
        llguidance_grammar(Constraint(ConstraintKind.JSON_SCHEMA, "{"))


def test_a_compile_that_raises_finishes_that_request_alone(tokenizer):
    engine = make_engine()

    def broken_load():
        raise RuntimeError("the tokenizer files are unreadable")

    engine.structured = StructuredOutput(broken_load, engine.model_config.vocab_size)
    prompt = tokenizer("Once upon a time").input_ids
    results = run(
        engine,
        {
            "constrained": sampled(schema(PERSON), 0),
            "free": greedy(8),
        },
        prompt,
    )
    engine.close()
    _, reason, error = results["constrained"]
    assert reason == FinishReason.ERROR, results["constrained"]
    expected = "params.json_schema failed to compile: RuntimeError: the tokenizer files"
    assert error.startswith(expected), error
    assert len(results["free"][0]) == 8 and results["free"][1] == FinishReason.LENGTH, results
