"""Tokenizing and chat templating off the event loop, within a character budget.

A prompt costs time in proportion to its length (about 2 ms per 1,000 characters with
SmolLM2's tokenizer on the 2-core development machine), and on the event loop that time
stops every other stream of the gateway. So text longer than INLINE_MAX_CHARS is tokenized
on a small thread pool, and shorter text inline, where the hop to a thread (about 0.2 ms)
would cost more than it saves. Text that cannot fit max_model_len however it is tokenized
(more characters than max_model_len times the longest token's) is refused before any work.

Structured-output constraints are compiled here too, before a request is queued, so that one
that does not compile, or is over the size or time limit, is refused naming its field: on a
pool of their own (a slow compile must not hold back tokenizing), with the compiler's cache
answering a known constraint inline.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from common.constraints import (
    Constraint,
    ConstraintError,
    ConstraintLimits,
    GrammarCompiler,
    llguidance_grammar,
    llguidance_tokenizer,
)
from common.model_text import ModelText
from common.templates import Message
from gateway.errors import InvalidArgument, Refused

INLINE_MAX_CHARS = 1000
T = TypeVar("T")


def check_text_budget(field_name: str, num_chars: int, model_text: ModelText) -> None:
    """Raises: InvalidArgument naming the field when `num_chars` is over the model's budget."""
    limits = model_text.limits
    if num_chars > limits.max_prompt_chars:
        raise InvalidArgument(
            field_name,
            f"{num_chars} characters; at most {limits.max_prompt_chars} can fit max_model_len "
            f"({limits.max_model_len} tokens of at most {model_text.longest_token_chars} "
            "characters)",
        )


def chat_chars(messages: list[Message], tools: list[dict] | None = None) -> int:
    """The characters a conversation's rendering costs: its text, calls and tools."""
    num_chars = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages)
    return num_chars + (len(json.dumps(tools)) if tools else 0)


class TextWork:
    """The model's text operations, each run inline or on the pool by its input's length."""

    def __init__(
        self, model_text: ModelText, threads: int, constraint_limits: ConstraintLimits | None = None
    ) -> None:
        self.model_text = model_text
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._grammar_pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        limits = model_text.limits
        self.compiler = GrammarCompiler(
            lambda: llguidance_tokenizer(
                model_text.hf_tokenizer, limits.vocab_size, list(limits.eos_token_ids)
            ),
            constraint_limits or ConstraintLimits(),
        )
        # llguidance's tokenizer takes about 1.5 s for a 49,152-entry vocabulary: built now,
        # beside serving, and never counted in a constraint's compile time.
        self._grammar_tokenizer = self._grammar_pool.submit(lambda: self.compiler.tokenizer)

    async def _run(self, num_chars: int, work: Callable[..., T], *args: object) -> T:
        if num_chars <= INLINE_MAX_CHARS:
            return work(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(work, *args))

    async def encode(
        self, field_name: str, text: str, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text`, after checking it against the budget (naming `field_name`)."""
        check_text_budget(field_name, len(text), self.model_text)
        return await self._run(len(text), self.model_text.encode, text, add_special_tokens)

    async def encode_chat(
        self, field_name: str, messages: list[Message], tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a conversation offering `tools`; raises ChatTemplateError as
        ModelText does."""
        num_chars = chat_chars(messages, tools)
        check_text_budget(field_name, num_chars, self.model_text)
        return await self._run(num_chars, self.model_text.encode_chat, messages, tools)

    async def render_chat(self, field_name: str, messages: list[Message]) -> str:
        """The prompt text of a conversation."""
        num_chars = chat_chars(messages)
        check_text_budget(field_name, num_chars, self.model_text)
        return await self._run(num_chars, self.model_text.render_chat, messages)

    async def check_constraint(self, constraint: Constraint | None) -> None:
        """Compile `constraint` (None: nothing to do), within the compiler's time limit.

        Raises:
            InvalidArgument: naming `params.<kind>`, when it is over the size limit, does not
                compile, or its compile takes longer than the time limit (then refused from
                the cache afterwards too).
            Refused: no compile thread was free within the time limit (retryable; nothing
                is cached).
        """
        if constraint is None:
            return
        try:
            if self.compiler.cached(constraint) is not None:
                return
            await self._compile_within_limit(constraint)
        except ConstraintError as error:
            raise InvalidArgument(f"params.{error.field}", error.problem) from None

    async def _compile_within_limit(self, constraint: Constraint) -> None:
        """The time limit counts the compile itself, from when a thread takes it, so time
        spent waiting behind other compiles never makes a constraint refused for good."""
        await asyncio.wrap_future(self._grammar_tokenizer)
        loop = asyncio.get_running_loop()
        started: asyncio.Future[float] = loop.create_future()

        def compile_timed() -> None:
            started_at = time.monotonic()
            loop.call_soon_threadsafe(_set_unless_done, started, started_at)
            self.compiler.matcher(constraint, started_at)

        job = self._grammar_pool.submit(compile_timed)
        compiling = asyncio.wrap_future(job)
        compiling.add_done_callback(_retrieve_exception)
        try:
            started_at = await self._compile_started(constraint, job, started)
            limit_s = self.compiler.limits.compile_timeout_s
            remaining_s = max(0.0, started_at + limit_s - time.monotonic())
            await asyncio.wait_for(asyncio.shield(compiling), remaining_s)
        except TimeoutError:
            refusal = self.compiler.timeout_refusal(constraint)
            self.compiler.remember_refusal(llguidance_grammar(constraint), refusal)
            raise refusal from None
        except asyncio.CancelledError:
            job.cancel()  # a compile still queued never runs for a caller that has gone
            raise

    async def _compile_started(
        self, constraint: Constraint, job: Future, started: asyncio.Future[float]
    ) -> float:
        """When a thread took the compile; Refused when none did within the time limit."""
        limit_s = self.compiler.limits.compile_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(started), limit_s)
        except TimeoutError:
            if not job.cancel():  # a thread took it just now
                return await started
        raise Refused(
            "constraint_timeout_s",
            f"params.{constraint.kind.value}: no compile thread was free within {limit_s:g} s "
            "(--constraint-timeout-s; all --tokenizer-threads are compiling other "
            "constraints); nothing was compiled, retry later",
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)


def _set_unless_done(future: asyncio.Future[float], value: float) -> None:
    if not future.done():
        future.set_result(value)


def _retrieve_exception(future: asyncio.Future) -> None:
    """Mark a compile's exception as seen (raised to its caller, or answered by the time
    limit when the caller stopped waiting)."""
    if not future.cancelled():
        future.exception()
