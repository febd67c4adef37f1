"""The configuration of speculative decoding (--speculative-config, docs/speculative.md): the
proposer, how many tokens it proposes, and the rule that skips proposals that do not pay."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

# Proposers of speculative decoding: prompt lookup (engine/speculative.py) or a smaller model
# with the same tokenizer (engine/draft.py).
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's --speculative-config, plus the thresholds of the rule that skips proposals."""

    method: str = "ngram"  # draft_model when `model` is given
    model: str | None = None  # draft_model: the draft's checkpoint folder or GGUF file
    num_speculative_tokens: int = 4  # k: tokens proposed per step at most
    prompt_lookup_max: int = 4  # the longest suffix looked up
    prompt_lookup_min: int = 2  # the shortest suffix looked up
    # above this many running requests no request proposes (vLLM's name for the threshold)
    disable_by_batch_size: int = 8
    max_temperature: float = 1.0  # a request sampled hotter than this never proposes
    min_acceptance_rate: float = 0.2  # below this recent rate a request stops proposing ...
    retry_after_steps: int = 32  # ... for this many of its steps, then tries again

    def __post_init__(self) -> None:
        _require_spec(
            self.method in SPECULATIVE_METHODS,
            "method",
            "one of " + ", ".join(SPECULATIVE_METHODS),
            self.method,
        )
        drafts = self.method == "draft_model"
        _require_spec(
            (self.model is not None) == drafts,
            "model",
            "a checkpoint folder or GGUF file with method draft_model, and only then",
            self.model,
        )
        _require_spec(
            not drafts or (isinstance(self.model, str) and os.path.exists(self.model)),
            "model",
            "an existing checkpoint folder or GGUF file",
            self.model,
        )
        _require_spec_int(self.num_speculative_tokens, "num_speculative_tokens", 1, 16)
        _require_spec_int(self.prompt_lookup_max, "prompt_lookup_max", 1, 64)
        _require_spec_int(self.prompt_lookup_min, "prompt_lookup_min", 1, self.prompt_lookup_max)
        _require_spec_int(self.disable_by_batch_size, "disable_by_batch_size", 1, 1 << 20)
        _require_spec_int(self.retry_after_steps, "retry_after_steps", 1, 1 << 20)
        _require_spec(
            _is_number(self.max_temperature) and self.max_temperature >= 0,
            "max_temperature",
            "a number >= 0",
            self.max_temperature,
        )
        _require_spec(
            _is_number(self.min_acceptance_rate) and 0 <= self.min_acceptance_rate <= 1,
            "min_acceptance_rate",
            "a number in [0, 1]",
            self.min_acceptance_rate,
        )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config of a --speculative-config JSON object (vLLM's: a `model` without a
        `method` is method draft_model).

        Raises:
            ValueError: not a JSON object, a key that is not a field, or a value out of
                range; the message names the key.
        """
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config must be a JSON object: {error}") from None
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
        if "model" in values:
            values.setdefault("method", "draft_model")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"speculative_config.{unknown[0]} is not a key; the keys are "
                + ", ".join(sorted(known))
            )
        return cls(**values)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_spec_int(value: object, field: str, low: int, high: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    _require_spec(ok, field, f"an integer in [{low}, {high}]", value)


def _require_spec(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{field} must be {allowed}, got {value!r}")
