"""The engine's side of structured output: compile off the step loop, mask, advance.

A request with a constraint gets an llguidance matcher. When its grammar is in the compiler's
cache the matcher is ready at once; otherwise it compiles on this module's thread while the
step loop goes on with the other requests, and the engine schedules the request once
`take_ready()` hands it back. Each step the matchers of the rows being sampled fill one
bitmask (llguidance's parallel executor), which the sampler applies to the logits; each
sampled token then advances its request's matcher. A request resumed with tokens an earlier
run produced replays them into its new matcher before it runs, so the mask continues where
that run stopped. Preemption needs nothing: the matcher follows the output tokens, which a
preempted request keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import llguidance
import llguidance.torch
import torch

from common.constraints import (
    ConstraintError,
    ConstraintLimits,
    GrammarCompiler,
    llguidance_tokenizer,
)
from common.model_text import ModelText
from engine.request import Request


@dataclass(slots=True)
class CompileFailure:
    """A request whose constraint did not compile (or did not accept its resumed tokens)."""

    request: Request
    message: str


class StructuredOutput:
    """Matchers of the engine's constrained requests."""

    def __init__(
        self,
        load_tokenizer: Callable[[], llguidance.LLTokenizer],
        vocab_size: int,
        limits: ConstraintLimits | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(load_tokenizer, limits or ConstraintLimits())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiling: dict[str, tuple[Request, Future[llguidance.LLMatcher]]] = {}
        self._mask_executor = llguidance.LLExecutor()

    @classmethod
    def for_model(cls, model: str, vocab_size: int, eos_token_ids: list[int]) -> StructuredOutput:
        """For the tokenizer of `model` (a checkpoint folder or GGUF file), loaded on first use."""

        def load() -> llguidance.LLTokenizer:
            return llguidance_tokenizer(ModelText(model).hf_tokenizer, vocab_size, eos_token_ids)

        return cls(load, vocab_size)

    def start(self, req: Request, replay: list[int]) -> bool:
        """Give `req` its matcher, with `replay` (resumed output tokens) consumed.

        Returns:
            True when the matcher is ready now; False when it compiles in the background
            (`take_ready` returns the request once it is done).

        Raises:
            ConstraintError: the constraint is over the size limit or was refused before.
        """
        template = self.compiler.cached(req.params.constraint)
        if template is not None:
            req.matcher = _replayed(template, replay)
            return True
        future = self._pool.submit(self._compile, req, replay)
        self._compiling[req.request_id] = (req, future)
        return False

    def _compile(self, req: Request, replay: list[int]) -> llguidance.LLMatcher:
        return _replayed(self.compiler.matcher(req.params.constraint), replay)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def take_ready(self) -> tuple[list[Request], list[CompileFailure]]:
        """Requests whose compile ended since the last call: those ready to run (matcher set),
        and those that failed."""
        ready, failed = [], []
        for request_id, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                req.matcher = future.result()
                ready.append(req)
            except ValueError as error:  # ConstraintError, or llguidance's own refusal
                failed.append(CompileFailure(req, f"params.{error}"))
            # Anything else a compile raises ends its request alone: escaping here it would
            # end the step loop, and every other request with it.
            except Exception as error:
                field = req.params.constraint.kind.value
                problem = f"{type(error).__name__}: {error}"
                failed.append(CompileFailure(req, f"params.{field} failed to compile: {problem}"))
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until a compile ends or `timeout_s` passes (for an engine with nothing else
        to run)."""
        if self._compiling:
            wait([f for _, f in self._compiling.values()], timeout_s, FIRST_COMPLETED)

    def cancel(self, request_id: str) -> bool:
        """Forget a compiling request (aborted). Returns: whether it was compiling."""
        entry = self._compiling.pop(request_id, None)
        if entry is not None:
            entry[1].cancel()
        return entry is not None

    def bitmask(
        self, reqs: list[Request], proposed: list[list[int]] | None = None
    ) -> torch.Tensor | None:
        """The allowed next tokens of each request as an int32 [len(reqs), words] bitmask
        (llguidance's layout: bit i of word j allows token 32 * j + i), all ones for requests
        without a constraint; None when no request has one.

        Args:
            proposed: per row, proposed tokens (engine/speculative.py) the row's request is
                taken to have produced first; its matcher is rolled back after. None: none.
        """
        proposed = proposed or [[] for _ in reqs]
        pairs = enumerate(zip(reqs, proposed, strict=True))
        constrained = [(r.matcher, row, p) for row, (r, p) in pairs if r.matcher is not None]
        if not constrained:
            return None
        bitmask = llguidance.torch.allocate_token_bitmask(len(reqs), self.vocab_size)
        rows = [(matcher, row) for matcher, row, tokens in constrained if not tokens]
        if rows:
            llguidance.torch.fill_next_token_bitmask_par(self._mask_executor, rows, bitmask)
        for matcher, row, tokens in constrained:
            if tokens:
                _fill_after(matcher, tokens, bitmask, row)
        return bitmask

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def advance(req: Request, token_id: int) -> str | None:
    """Feed a sampled token to the request's matcher; returns what went wrong, or None."""
    if req.matcher is None or req.matcher.consume_token(token_id):
        return None
    return f"the constraint refused token {token_id}: {req.matcher.get_error()}"


def _fill_after(
    matcher: llguidance.LLMatcher, tokens: list[int], bitmask: torch.Tensor, row: int
) -> None:
    """Fill `row` with what the matcher allows after `tokens` (which it accepts: proposals are
    cut to the prefix their constraint accepts), leaving the matcher as it was."""
    if not matcher.consume_tokens(tokens):
        raise RuntimeError(f"the constraint refused proposed tokens: {matcher.get_error()}")
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
    matcher.rollback(len(tokens))


def _replayed(matcher: llguidance.LLMatcher, replay: list[int]) -> llguidance.LLMatcher:
    if replay and not matcher.consume_tokens(replay):
        raise ConstraintError(
            "constraint", f"does not accept the resumed tokens: {matcher.get_error()}"
        )
    return matcher
