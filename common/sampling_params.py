"""Per-request sampling parameters, validated when built: the one definition of their
ranges, used by the engine and by the gateway (which names the field as its proto does)."""

import math
from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 16  # when a request sets none
MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1
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
