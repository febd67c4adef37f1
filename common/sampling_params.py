"""Per-request sampling parameters, validated when built: the one definition of their
ranges, used by the engine and by the gateway (which names the field as its proto does)."""

import math
from dataclasses import dataclass, field

from common.constraints import Constraint

DEFAULT_MAX_TOKENS = 16  # when a request sets none
MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1
MAX_LOGIT_BIAS = 100.0  # |bias| added to a token's logit, as OpenAI bounds it
# Most sequences (n, best_of) one request may run: they share one executor's batch.
MAX_N = 16
# Choice i > 0 of a seeded request draws from seed + i * SEED_STRIDE (mod 2**64): a stream of
# its own, reproducible from the request's seed and its index; choice 0 uses the seed itself.
SEED_STRIDE = 0x9E3779B97F4A7C15
# Temperatures below this are sampled greedily: dividing logits by a smaller
# number overflows float32 and the distribution is one-hot anyway (as in vLLM).
GREEDY_TEMPERATURE = 1e-5


class SamplingParamError(ValueError):
    """A sampling field out of its range: `field` is its name, `problem` what is wrong."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(slots=True)
class SamplingParams:
    """How the next tokens of one request are chosen and when it stops on token ids."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Each prompt token's logprob (after the first, which has none) with this many of the most
    # likely alternatives; None: not reported. Such a request computes its whole prompt (the
    # prefix and session caches are not used for it).
    prompt_logprobs: int | None = None
    # Structured output: the output must match it (common/constraints.py); None: free text.
    constraint: Constraint | None = None
    # Added to the logits of these token ids before sampling, each in [-100, 100].
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Only these token ids may be sampled; None: any.
    allowed_token_ids: list[int] | None = None
    # Text side, applied where text is made (the gateway): keep the matched stop string at
    # the end of the text, and leave special tokens (BOS, EOS, control tokens) out of it.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Choices returned, each its own sequence sharing the prompt's KV blocks.
    n: int = 1
    # Sequences run, of which the n with the highest cumulative logprob are returned; None: n.
    best_of: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature, 0.0, math.inf, "[0, inf)")
        _check_int("top_k", self.top_k, low=0)
        _check_number("top_p", self.top_p, 0.0, 1.0, "(0, 1]", low_open=True)
        _check_number("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        _check_number(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, "(0, inf)", low_open=True
        )
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise SamplingParamError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        self.stop_token_ids = _checked_token_ids("stop_token_ids", self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        self._check_logit_masks()
        self._check_choices()
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamError(name, f"must be a bool, got {getattr(self, name)!r}")

    def _check_logit_masks(self) -> None:
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise SamplingParamError("constraint", f"must be a Constraint, got {self.constraint!r}")
        if self.constraint is not None and self.ignore_eos:
            raise SamplingParamError(
                "ignore_eos", "cannot be combined with a constraint (it decides where output ends)"
            )
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamError(
                "logit_bias", f"must map token ids to numbers, got {self.logit_bias!r}"
            )
        _checked_token_ids("logit_bias", list(self.logit_bias))
        for token_id, bias in self.logit_bias.items():
            _check_number(
                f"logit_bias[{token_id}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "[-100, 100]"
            )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _checked_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise SamplingParamError("allowed_token_ids", "must not be empty when set")

    def _check_choices(self) -> None:
        _check_int("n", self.n, low=1, high=MAX_N)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, low=1, high=MAX_N)
            if self.best_of < self.n:
                raise SamplingParamError("best_of", f"must be >= n ({self.n}), got {self.best_of}")

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: best_of when set, else n."""
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the most likely one (argmax)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when repetition, presence or frequency penalties change the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def masks_logits(self) -> bool:
        """True when a constraint, logit_bias or allowed_token_ids changes the logits."""
        return (
            self.constraint is not None
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
        )

    def max_token_id(self) -> int:
        """The largest token id the parameters name (-1: none), to check against a vocabulary."""
        named = [*self.stop_token_ids, *self.logit_bias, *(self.allowed_token_ids or [])]
        return max(named, default=-1)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed` (choice 0: the seed)."""
    return (seed + index * SEED_STRIDE) % (MAX_SEED + 1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise SamplingParamError(name, f"must be {allowed}, got {value!r}")


def _check_number(
    name: str, value: object, low: float, high: float, allowed: str, low_open: bool = False
) -> None:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not is_number or math.isnan(value) or math.isinf(value):
        raise SamplingParamError(name, f"must be a finite number in {allowed}, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        raise SamplingParamError(name, f"must be in {allowed}, got {value!r}")


def _checked_token_ids(name: str, value: object) -> list[int]:
    if not isinstance(value, list | tuple):
        raise SamplingParamError(name, f"must be a list of token ids >= 0, got {value!r}")
    for token_id in value:
        if not _is_int(token_id) or token_id < 0:
            raise SamplingParamError(name, f"must hold token ids >= 0, got {token_id!r}")
    return list(value)
