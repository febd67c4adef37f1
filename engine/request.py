"""A request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One generation: its tokens, how far its KV is computed, and its blocks.

    There is no prefill or decode phase: `num_computed_tokens` trails `num_tokens`, and each
    step the scheduler gives the request some of the difference (all of it, or a chunk).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int  # FCFS order among requests of one priority
    priority: int = 0  # lower runs first
    session_id: str | None = None
    # False once its session was ended while it ran: its blocks are freed, not pinned
    pins_session: bool = True
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    # llguidance.LLMatcher of its constraint (engine/structured.py), advanced with each token
    matcher: object | None = None
    all_token_ids: list[int] = field(default_factory=list)  # prompt followed by output
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)  # swapped out: K/V in the host tier
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # leading blocks published in the prefix cache
    num_cached_tokens: int | None = None  # prompt tokens found in the cache at first admission
    waiting_since_step: int = 0  # the scheduler's step count when it last joined the queue
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Sequence groups (SamplingParams.n, best_of): each choice is a Request of its own, whose
    # request_id is the choice's (common.choices); group_id is the request's id as added.
    group_id: str = ""
    index: int = 0  # the choice this sequence is
    num_forks: int = 0  # sequences still to fork from this one once its prompt is computed
    unwanted_choices: set[int] = field(default_factory=set)  # aborted before they forked
    # its last block may be shared with the sequences it forked from or into: copied on write
    shares_tail: bool = False
    # Speculative decoding (engine/speculative.py): recent share of proposed tokens accepted
    # (a new request starts halfway: a first fully rejected draft can stop it), and steps it
    # has gone without proposals since that share fell below the threshold.
    spec_acceptance_rate: float = 0.5
    spec_skipped_steps: int = 0
    # SamplingParams.prompt_logprobs: entry p is prompt token p + 1's, filled as the prompt's
    # chunks are computed and sent with the first output token (then prompt_logprobs_sent).
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not sent yet: every prompt position's logits
        are needed, so no cached prefix may stand in for them."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def max_cached_tokens(self) -> int:
        """The most leading tokens a cache hit may cover: never the last one, whose logits
        the request still needs, and none while it wants its prompt's logprobs."""
        return 0 if self.wants_prompt_logprobs else self.num_tokens - 1

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_seq)
