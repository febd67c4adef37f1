"""SamplingParams.prompt_logprobs: the logprob of each prompt token under the logits row that
predicts it, recorded as the prompt's chunks run and sent once, with a sequence's first output."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import TokenLogprobs, token_logprobs
from engine.step_scheduler import ScheduledRequest


def record_prompt_logprobs(scheduled: ScheduledRequest, logits: torch.Tensor) -> None:
    """Record the logprobs of the prompt tokens that this step's rows of `scheduled`
    predict (row i is position start + i, predicting the token after it)."""
    req = scheduled.request
    start = req.num_computed_tokens
    num_rows = min(scheduled.num_new_tokens, req.num_prompt_tokens - 1 - start)
    del req.prompt_logprobs[start:]  # recomputed after a preemption
    if num_rows > 0:
        targets = req.prompt_token_ids[start + 1 : start + 1 + num_rows]
        req.prompt_logprobs += token_logprobs(
            logits[:num_rows], targets, req.params.prompt_logprobs
        )


def take_prompt_logprobs(req: Request) -> list[TokenLogprobs] | None:
    """The prompt's logprobs, once, with a sequence's first output."""
    if not req.wants_prompt_logprobs:
        return None
    req.prompt_logprobs_sent = True
    return req.prompt_logprobs
