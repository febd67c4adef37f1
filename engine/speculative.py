"""Speculative decoding: n-gram prompt-lookup proposals, and when to make them.

A decoding request may be given k proposed tokens for a step; the model then computes the
k + 1 positions (its last token and the proposals) in one forward pass over the paged cache,
the way a prompt chunk is computed, and the engine keeps the longest prefix of proposals the
target model agrees with, plus the target's own next token (engine/engine.py verifies).

The n-gram proposer needs no second model (engine/draft.py runs one): it looks for the
longest suffix of the request's tokens (prompt and output, `prompt_lookup_min` to
`prompt_lookup_max` tokens long) that occurred before, most recent occurrence first, and
proposes the up to `num_speculative_tokens` tokens that followed it (vLLM's "ngram" method,
prompt lookup decoding).

Proposing is skipped where it would cost more than it saves (`proposes`):
a step with more than `disable_by_batch_size` running requests (the forward pass is no longer
bound by reading the weights, so extra positions cost compute), a request sampled at a
temperature above `max_temperature`, or one whose recent acceptance rate fell below
`min_acceptance_rate` (it tries again after `retry_after_steps` steps without proposals).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, TokenLogprobs
from engine.speculative_config import SpeculativeConfig

# The weight of the newest step in a request's acceptance rate (an exponential moving average).
ACCEPTANCE_SMOOTHING = 0.5


def proposes(config: SpeculativeConfig, req: Request, num_running: int) -> bool:
    """The rule: whether `req` gets proposals this step (see the module docstring); only
    a decoding request (one token left to compute, no forks pending) may."""
    if req.num_tokens - req.num_computed_tokens != 1 or req.num_forks:
        return False
    if num_running > config.disable_by_batch_size:
        return False
    if req.params.temperature > config.max_temperature:
        return False
    if req.spec_acceptance_rate >= config.min_acceptance_rate:
        return True
    req.spec_skipped_steps += 1
    if req.spec_skipped_steps < config.retry_after_steps:
        return False
    req.spec_skipped_steps = 0
    req.spec_acceptance_rate = config.min_acceptance_rate  # one more chance
    return True


def record_acceptance(req: Request, num_proposed: int, num_accepted: int) -> None:
    """Fold one verified step into the request's recent acceptance rate."""
    rate = num_accepted / num_proposed
    req.spec_acceptance_rate += ACCEPTANCE_SMOOTHING * (rate - req.spec_acceptance_rate)


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest suffix of
    `token_ids` of `min_n` to `max_n` tokens; at most `max_tokens`, none without a match."""
    if max_tokens <= 0 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # windows starting before len - n: an occurrence other than the suffix itself
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return tokens[follow : follow + max_tokens].tolist()
    return []


class NgramProposer:
    """Makes each step's proposals for the running requests the rule lets propose."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, eos_token_ids: list[int]
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Proposals by request id, for decoding requests only (one token left to compute)."""
        proposals: dict[str, list[int]] = {}
        for req in running:
            if not proposes(self.config, req, len(running)):
                continue
            tokens = self._propose(req)
            if tokens:
                proposals[req.request_id] = tokens
        return proposals

    def _propose(self, req: Request) -> list[int]:
        config = self.config
        room = proposal_room(req, config, self.max_model_len)
        tokens = propose_ngram(
            req.all_token_ids, config.prompt_lookup_min, config.prompt_lookup_max, room
        )
        return cut_at_stop(tokens, req, self.eos_token_ids)


def proposal_room(req: Request, config: SpeculativeConfig, max_model_len: int) -> int:
    """How many tokens a request may be proposed: as many as it may still produce after
    this step's own one (max_tokens, the model's length), at most num_speculative_tokens."""
    return min(
        req.params.max_tokens - req.num_output_tokens - 1,
        max_model_len - req.num_tokens - 1,
        config.num_speculative_tokens,
    )


def cut_at_stop(tokens: list[int], req: Request, eos_token_ids: set[int]) -> list[int]:
    """The proposal before its first stop or end-of-sequence token (the model's own token
    after the proposals may still be one; no position is computed past one), then only as
    much as the request's constraint accepts."""
    stops = eos_token_ids.union(req.params.stop_token_ids)
    for i, token_id in enumerate(tokens):
        if token_id in stops:
            tokens = tokens[:i]
            break
    if req.matcher is not None and tokens:
        tokens = tokens[: req.matcher.validate_tokens(tokens)]
    return tokens


@dataclass(slots=True)
class Accepted:
    """What one request's sampled rows give it: the tokens it keeps, in order."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # one per token (None: not asked for)
    blocked: bool = False  # the row after the last token had no allowed token


@dataclass(slots=True)
class SpecCounters:
    """Cumulative counts of verified proposals."""

    num_drafts: int = 0  # steps in which a request verified proposed tokens
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0  # proposed tokens the target agreed with
    num_bonus_tokens: int = 0  # the target's own token after a fully accepted proposal


class Verifier:
    """Keeps the proposed tokens the target agrees with, and undoes the rest.

    Each proposed position is sampled as the step without proposals would sample it (the
    same masks, penalties and, for a seeded request, the same draws of its generator), and
    a proposal is kept while it equals the target's token. For a greedy request that is
    the longest prefix matching the argmax plus one token. For a sampled one it is
    rejection sampling with a one-hot proposal: token t is kept with probability p(t), and
    when it is not, the target's token is distributed as p with t removed and
    renormalised; the output distribution is exactly the target's, and a seeded request
    gives the same tokens with or without speculation.
    """

    def __init__(self, kv_cache: KVCacheManager, sampler: Sampler, vocab_size: int) -> None:
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.counters = SpecCounters()

    def draws_before(self, sampling: list[tuple[Request, list[int]]]) -> dict[int, torch.Tensor]:
        """The generator states of the seeded, sampled requests verifying proposals, by
        id(request), taken before their rows draw."""
        return {
            id(req): req.generator.get_state()
            for req, proposed in sampling
            if proposed and req.generator is not None and not req.params.is_greedy
        }

    def accepted(
        self, req: Request, proposed: list[int], sampled: SamplerOutput, first_row: int
    ) -> Accepted:
        """The tokens of the rows from `first_row`: each row's token, up to the first that
        differs from the proposal (or the last row)."""
        kept = Accepted([], [])
        for j in range(1 + len(proposed)):
            row = first_row + j
            if row in sampled.blocked_rows:
                kept.blocked = True
                break
            kept.token_ids.append(sampled.token_ids[row])
            kept.logprobs.append(sampled.logprobs[row])
            if j == len(proposed) or sampled.token_ids[row] != proposed[j]:
                break
        return kept

    def rewind(self, req: Request, draws: dict[int, torch.Tensor], num_tokens: int) -> None:
        """Leave a seeded request's generator past the draws of its `num_tokens` tokens
        only, as the steps without proposals would have."""
        state = draws.get(id(req))
        if state is not None:
            req.generator.set_state(state)
            self.sampler.skip_draws(req.generator, num_tokens, self.vocab_size)

    def roll_back(self, req: Request, proposed: list[int], token_ids: list[int]) -> None:
        """Count the step, then keep the K/V of the accepted proposals only: computed
        tokens and blocks as a step without proposals leaves them."""
        num_accepted = 0
        while num_accepted < min(len(proposed), len(token_ids)) and (
            token_ids[num_accepted] == proposed[num_accepted]
        ):
            num_accepted += 1
        counters = self.counters
        counters.num_drafts += 1
        counters.num_proposed_tokens += len(proposed)
        counters.num_accepted_tokens += num_accepted
        counters.num_bonus_tokens += len(token_ids) > len(proposed)
        record_acceptance(req, len(proposed), num_accepted)
        req.num_computed_tokens = req.num_tokens - 1
        self.kv_cache.trim_slots(req)
        self.kv_cache.register_computed_blocks(req)
