"""Compiling constraints with llguidance on stories260K's tokenizer: a lookup never waits for
the tokenizer's load, text nested too deeply is refused naming its field, and the gateway's
time limit counts a compile itself, never the wait for a compile thread."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from common.constraints import (
    Constraint,
    ConstraintError,
    ConstraintKind,
    ConstraintLimits,
    GrammarCompiler,
    llguidance_grammar,
    llguidance_tokenizer,
)
from common.model_text import ModelText
from gateway.errors import InvalidArgument, Refused
from gateway.text_work import TextWork
from tests.helpers import STORIES_260K

PERSON = Constraint(
    ConstraintKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {"name": {"type": "string"}}}),
)
COLORS = Constraint(ConstraintKind.CHOICE, choices=("red", "green", "blue"))
# How long a test waits for a thread it started before calling it stuck (a guard against a
# hang, never a measure of speed).
STUCK_S = 60


@pytest.fixture(scope="module")
def model_text() -> ModelText:
    return ModelText(STORIES_260K)


def load_tokenizer(model_text: ModelText):
    limits = model_text.limits
    return llguidance_tokenizer(
        model_text.hf_tokenizer, limits.vocab_size, list(limits.eos_token_ids)
    )


def test_a_cache_lookup_does_not_wait_for_the_tokenizer_load(model_text):
    loading, proceed = threading.Event(), threading.Event()
    released: list[bool] = []

    def held_load():
        loading.set()
        released.append(proceed.wait(STUCK_S))
        return load_tokenizer(model_text)

    compiler = GrammarCompiler(held_load, ConstraintLimits())
    compiling = threading.Thread(target=compiler.matcher, args=(PERSON,))
    compiling.start()
    assert loading.wait(STUCK_S), "the compile never started loading the tokenizer"
    found = compiler.cached(COLORS)  # on a loop: must answer while the load goes on
    proceed.set()
    compiling.join()
    assert found is None, f"a grammar never compiled was found: {found}"
    assert released == [True], "the lookup waited until the tokenizer load gave up"
    assert compiler.cached(PERSON) is not None, "the compile did not cache its matcher"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[" * 10_000 + "]" * 10_000, "json_schema is nested too deeply"),
        ('{"a":' * 500 + "{}" + "}" * 500, "json_schema does not compile: recursion limit"),
    ],
    ids=["json-arrays", "schema-objects"],
)
def test_deeply_nested_schemas_are_refused_naming_the_field(text, problem):
    with pytest.raises(ConstraintError) as refused:
        llguidance_grammar(Constraint(ConstraintKind.JSON_SCHEMA, text))
    assert str(refused.value).startswith(problem), str(refused.value)


class HeldCompiler(GrammarCompiler):
    """A GrammarCompiler whose compile of `held` waits for `release` before it runs, as a
    schema that takes long to compile would."""

    def __init__(self, original: GrammarCompiler, held: Constraint) -> None:
        super().__init__(lambda: original.tokenizer, original.limits)
        self.held = held
        self.entered = threading.Event()
        self.release = threading.Event()

    def matcher(self, constraint: Constraint, started_at: float | None = None):
        if constraint == self.held:
            self.entered.set()
            self.release.wait(STUCK_S)
        return super().matcher(constraint, started_at)


def test_waiting_for_a_compile_thread_is_a_retryable_refusal_and_caches_nothing(model_text):
    work = TextWork(
        model_text, threads=1, constraint_limits=ConstraintLimits(compile_timeout_s=0.05)
    )
    held = HeldCompiler(work.compiler, PERSON)
    work.compiler = held

    async def scenario() -> None:
        slow = asyncio.create_task(work.check_constraint(PERSON))
        assert await asyncio.to_thread(held.entered.wait, STUCK_S), "no compile started"
        with pytest.raises(Refused) as waited:  # the one compile thread is busy
            await work.check_constraint(COLORS)
        assert waited.value.code.name == "RESOURCE_EXHAUSTED", waited.value.code
        assert str(waited.value).startswith("params.choice: no compile thread was free")
        assert held.cached(COLORS) is None, "the wait for a thread was cached as a refusal"
        with pytest.raises(InvalidArgument, match="took longer than 0.05 s") as timed_out:
            await slow
        again = await asyncio.gather(work.check_constraint(PERSON), return_exceptions=True)
        assert str(again[0]) == str(timed_out.value), "a repeat was not refused from the cache"
        held.release.set()
        # A limit no compile reaches: what follows must not depend on the machine's speed.
        held.limits = ConstraintLimits(compile_timeout_s=STUCK_S)
        await work.check_constraint(COLORS)  # compiles now: its wait cached no refusal

    try:
        asyncio.run(scenario())
    finally:
        held.release.set()
        work.close()
    assert held.cached(COLORS) is not None, "the ordinary constraint was not compiled"
    with pytest.raises(ConstraintError, match="took longer than 0.05 s"):
        held.cached(PERSON)  # its compile ended past the limit: refused for good
