"""Structured output: what a request's output must match, and its compilation by llguidance.

A `Constraint` is the one internal form every front fills (kvgate.v1's SamplingParams oneof,
OpenAI's response_format, vLLM's structured outputs): a kind and its text (or choices). It
becomes an llguidance grammar, and with the model's tokenizer an `LLMatcher`, which gives the
tokens allowed next and advances with each sampled one.

Compiling costs from well under a millisecond to seconds (large or deeply nested schemas), so
it runs on a thread (llguidance drops the GIL while it builds a matcher), never on an event
loop or the engine's step loop, and its result is cached: a `GrammarCompiler` serves one
tokenizer, so its cache is keyed by (grammar, tokenizer). Limits bound the text's size and
llguidance's work (its lexer fuel and grammar size); the gateway adds a wall-clock limit.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import llguidance.hf


class ConstraintKind(enum.Enum):
    """What the output must be; each value is the kvgate.v1.SamplingParams field's name."""

    JSON_SCHEMA = "json_schema"  # JSON text that validates against a JSON Schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"  # text that fully matches a regular expression (Rust regex syntax)
    GRAMMAR = "grammar"  # text of a Lark grammar, as llguidance reads it
    CHOICE = "choice"  # exactly one of a list of strings


class ConstraintError(ValueError):
    """A constraint refused: `field` is its kind's field name, `problem` what is wrong."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's structured-output constraint.

    `text` holds the JSON Schema (JSON_SCHEMA), the regex (REGEX) or the Lark grammar
    (GRAMMAR), and is empty for JSON_OBJECT and CHOICE; `choices` holds CHOICE's strings.
    """

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        field = self.kind.value
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices or any(not c for c in self.choices):
                raise ConstraintError(field, "must hold at least one non-empty string")
        elif self.choices:
            raise ConstraintError(field, "takes no choices")
        if self.kind in _TEXT_KINDS and not self.text:
            raise ConstraintError(field, "must not be empty")
        if self.kind not in _TEXT_KINDS and self.text:
            raise ConstraintError(field, "takes no text")

    @property
    def num_chars(self) -> int:
        """The size the limits count: the text, or all choices together."""
        return len(self.text) + sum(len(c) for c in self.choices)


# JSON is written compactly (", " and ": " between items, no other whitespace): a model
# allowed free whitespace can spend its whole max_tokens on newlines. A schema's own
# "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_flexible": False}

_TEXT_KINDS = {ConstraintKind.JSON_SCHEMA, ConstraintKind.REGEX, ConstraintKind.GRAMMAR}


@dataclass(frozen=True, slots=True)
class ConstraintLimits:
    """How large a constraint may be and how much compiling it may cost."""

    max_chars: int = 65_536  # of the schema, regex or grammar text (choices: all together)
    compile_timeout_s: float = 5.0  # wall clock, enforced where a caller waits (the gateway)
    lexer_fuel: int = 1_000_000  # llguidance's initial_lexer_fuel (about 50k a millisecond)
    max_grammar_size: int = 500_000  # llguidance's max_grammar_size (symbols)
    max_cached: int = 256  # compiled grammars kept (least recently used dropped)

    def __post_init__(self) -> None:
        for name in ("max_chars", "lexer_fuel", "max_grammar_size", "max_cached"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")


def llguidance_grammar(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not compiled yet).

    Raises:
        ConstraintError: a JSON schema that is not a JSON object, or text that llguidance's
            grammar builders refuse (nested too deeply, a regex or grammar they cannot read).
    """
    field = constraint.kind.value
    try:
        return _grammar(constraint)
    except RecursionError:
        raise ConstraintError(field, "is nested too deeply") from None
    except json.JSONDecodeError as error:
        raise ConstraintError(field, f"is not valid JSON: {error}") from None
    except ConstraintError:
        raise
    except ValueError as error:  # llguidance's builders refuse with ValueError
        raise ConstraintError(field, f"does not compile: {_short(str(error))}") from None


def _grammar(constraint: Constraint) -> str:
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        schema = json.loads(constraint.text)
        if not isinstance(schema, dict | bool):
            raise ConstraintError(kind.value, "must be a JSON object (a JSON Schema)")
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.text, JSON_OPTIONS)
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.text)
    if kind is ConstraintKind.GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(constraint.text)
    literals = " | ".join(json.dumps(choice) for choice in constraint.choices)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {literals}")


def llguidance_tokenizer(
    hf_tokenizer: object, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, for a model of `vocab_size` logits
    whose end-of-sequence tokens are `eos_token_ids` (all allowed where the grammar accepts)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)


class GrammarCompiler:
    """Compiles constraints for one tokenizer, with a cache; safe to call from threads.

    `matcher()` blocks while it compiles: call it on a thread, not on a loop.
    """

    def __init__(
        self, load_tokenizer: Callable[[], llguidance.LLTokenizer], limits: ConstraintLimits
    ) -> None:
        """Args:
        load_tokenizer: builds the tokenizer (about a second for large vocabularies); called
            once, on the first compile.
        limits: size and work limits.
        """
        self.limits = limits
        self._load_tokenizer = load_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._parser_limits = llguidance.LLParserLimits(
            initial_lexer_fuel=limits.lexer_fuel, max_grammar_size=limits.max_grammar_size
        )
        self._cache: OrderedDict[str, llguidance.LLMatcher | ConstraintError] = OrderedDict()
        # `_lock` guards only the cache's dict operations, so a lookup on a loop never waits;
        # the tokenizer's load (seconds) holds `_tokenizer_lock`, which only compiles take.
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer, loaded on first use (blocks while it loads: not for a loop)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def check_size(self, constraint: Constraint) -> None:
        """Raises: ConstraintError when the constraint is over the size limit."""
        if constraint.num_chars > self.limits.max_chars:
            raise ConstraintError(
                constraint.kind.value,
                f"has {constraint.num_chars} characters; at most {self.limits.max_chars}",
            )

    def cached(self, constraint: Constraint) -> llguidance.LLMatcher | None:
        """A fresh matcher when the constraint's grammar is compiled already (cheap), else None.

        Raises:
            ConstraintError: the constraint was refused before (cached refusal).
        """
        self.check_size(constraint)
        return self._lookup(llguidance_grammar(constraint))

    def matcher(
        self, constraint: Constraint, started_at: float | None = None
    ) -> llguidance.LLMatcher:
        """A matcher in its start state, compiled now or taken from the cache.

        Args:
            started_at: when this compile started (`time.monotonic()`); given, a compile
                that ends more than `limits.compile_timeout_s` later is refused for its time
                (and that refusal cached), also when llguidance built a matcher.

        Raises:
            ConstraintError: naming the kind's field, when the constraint is over the size
                limit, does not compile, costs more than the work limits, or (`started_at`
                given) takes longer than the time limit.
        """
        self.check_size(constraint)
        grammar = llguidance_grammar(constraint)
        found = self._lookup(grammar)
        if found is not None:
            return found
        compiled = llguidance.LLMatcher(
            self.tokenizer, grammar, log_level=0, limits=self._parser_limits
        )
        result = compiled
        if started_at is not None and time.monotonic() - started_at > self.limits.compile_timeout_s:
            result = self.timeout_refusal(constraint)
        elif compiled.is_error():
            result = ConstraintError(
                constraint.kind.value, f"does not compile: {_short(compiled.get_error())}"
            )
        self.remember(grammar, result)
        if isinstance(result, ConstraintError):
            raise result
        return compiled.deep_copy()

    def remember(self, grammar: str, result: llguidance.LLMatcher | ConstraintError) -> None:
        """Cache a compiled matcher (kept in its start state) or a refusal of `grammar`."""
        with self._lock:
            self._store(grammar, result)

    def _store(self, grammar: str, result: llguidance.LLMatcher | ConstraintError) -> None:
        self._cache[grammar] = result
        self._cache.move_to_end(grammar)
        while len(self._cache) > self.limits.max_cached:
            self._cache.popitem(last=False)

    def timeout_refusal(self, constraint: Constraint) -> ConstraintError:
        """The refusal of a constraint whose compile ran past `limits.compile_timeout_s`."""
        limit_s = self.limits.compile_timeout_s
        return ConstraintError(
            constraint.kind.value, f"took longer than {limit_s:g} s to compile (the limit)"
        )

    def remember_refusal(self, grammar: str, refusal: ConstraintError) -> None:
        """Cache `refusal` of `grammar` unless a result of it is cached already (a compile's
        own result is never overwritten)."""
        with self._lock:
            if grammar not in self._cache:
                self._store(grammar, refusal)

    def _lookup(self, grammar: str) -> llguidance.LLMatcher | None:
        with self._lock:
            found = self._cache.get(grammar)
            if found is None:
                return None
            self._cache.move_to_end(grammar)
        if isinstance(found, ConstraintError):
            raise found
        return found.deep_copy()


def _short(error: str, limit: int = 500) -> str:
    """llguidance's error, cut to a length a status message can carry."""
    text = " ".join(error.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
