"""The checks of a request the engine is given (Engine.add_request, Engine.prompt_logits): each
raises a ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from common.sampling_params import SamplingParams
from engine.groups import Sequences


@dataclass(frozen=True, slots=True)
class RequestChecks:
    """A request's fields against this engine: its model's context and vocabulary, and the
    ids of the sequences it runs."""

    max_model_len: int
    vocab_size: int
    requests: Sequences

    def request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        session_id: str | None,
        cache_salt: str | None,
    ) -> None:
        """Raises: ValueError naming the field, or saying the id is in use."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if self.requests.in_use(request_id, params.num_sequences):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError(f"session_id must be a non-empty string or None, got {session_id!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
        self.prompt(prompt_token_ids)
        if params.max_token_id() >= self.vocab_size:
            raise ValueError(
                f"params name token id {params.max_token_id()} (stop_token_ids, logit_bias or "
                f"allowed_token_ids); the vocabulary has {self.vocab_size}"
            )

    def prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises: ValueError naming prompt_token_ids when they are no prompt this model can
        take (empty, not shorter than max_model_len, or an id outside the vocabulary)."""
        if not isinstance(prompt_token_ids, (list, tuple)):
            kind = type(prompt_token_ids).__name__
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {kind}")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {len(prompt_token_ids)} tokens; it must be shorter than "
                f"max_model_len ({self.max_model_len}) to leave room for output"
            )
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < vocab]  # fmt: skip
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad[:5]}")
