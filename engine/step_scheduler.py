"""Step scheduler: which requests run in the next forward pass, and how many tokens each.

Running requests go first (each gets what it still needs, within the token budget), then
waiting ones in policy order while sequences, budget and blocks allow: by priority, then
arrival (fcfs) or the longest cached prefix first (lpm, with aging). A long prompt is cut
into chunks by the budget, so decodes keep flowing beside it. When blocks run out, the
lowest-priority, newest running request is preempted: its blocks are swapped out to the
host tier (preemption mode swap, while the tier has room) and back when it is admitted again,
or dropped and recomputed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens of K/V computed for it this step
    samples: bool  # the step reaches its last known token, so a new token is sampled
    # Logits wanted from its last new tokens: 1 when it samples, all of them while its
    # prompt's logprobs are wanted (Request.wants_prompt_logprobs), else 0; with proposed
    # tokens, 1 + their number.
    logit_rows: int = 0
    # proposed tokens verified this step (engine/speculative.py): computed after the
    # request's last token, each position sampled; counted in num_new_tokens
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """The decision for one step, in batch order: one-token requests first, then the rest."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0  # total new tokens in the step
    preempted_ids: list[str] = field(default_factory=list)  # sent back to the waiting queue

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# lpm orders at most this many of the oldest waiting requests each step (SGLang falls back
# to fcfs past 128 waiting requests for the same reason: matching costs time every step).
LPM_WINDOW = 128


class StepScheduler:
    """Decides each step's batch; owns the waiting and running queues."""

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by sort_key (priority, arrival)
        self.running: list[Request] = []  # sorted by sort_key
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.num_batched_tokens = 0  # cumulative tokens of all steps
        self.num_steps = 0  # schedule() calls: the clock of lpm's aging

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        req.waiting_since_step = self.num_steps
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def schedule(self, proposals: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Choose the next step's requests and their token counts, allocating their blocks.

        Args:
            proposals: proposed tokens of decoding requests by request id, verified this step
                where the token budget and free blocks allow (never preempting for them).

        Returns:
            The step's decision; empty when nothing can run.
        """
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget, proposals or {})
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        self.num_batched_tokens += out.num_batched_tokens
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, proposals: dict[str, list[int]]
    ) -> int:
        scheduled: set[str] = set()
        # one-token requests (decodes) first, so a long chunked prefill never stalls them
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            spec = self._room_for_proposal(req, proposals.get(req.request_id), budget)
            if spec:
                scheduled.add(req.request_id)
                out.scheduled.append(
                    ScheduledRequest(req, 1 + len(spec), True, 1 + len(spec), spec)
                )
                budget -= 1 + len(spec)
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, num_new, scheduled, out):
                continue
            scheduled.add(req.request_id)
            out.scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
        return budget

    def _room_for_proposal(
        self, req: Request, proposal: list[int] | None, budget: int
    ) -> list[int]:
        """The part of a decoding request's proposal the budget leaves room for, with its
        slots allocated; empty when there is none or its blocks are not free."""
        if not proposal or req.num_tokens - req.num_computed_tokens != 1:
            return []
        spec = proposal[: budget - 1]
        kv = self.kv_cache
        # free blocks only, leaving one per running request (its next token's) and one for a
        # copy on write: a proposal never evicts a session or preempts a request
        spare = kv.num_free_blocks - len(self.running)
        if not spec or kv.num_blocks_needed(req, 1 + len(spec)) >= spare:
            return []
        if not kv.allocate_slots(req, 1 + len(spec)):
            return []
        return spec

    def _allocate_or_preempt(
        self, req: Request, num_new: int, scheduled: set[str], out: SchedulerOutput
    ) -> bool:
        while not self.kv_cache.allocate_slots(req, num_new):
            victim = max(
                (r for r in self.running if r.request_id not in scheduled),
                key=lambda r: r.sort_key,
            )
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if not (self.config.swaps_on_preemption and self.kv_cache.swap_out(req)):
            self.kv_cache.free(req)  # recomputed from its first token when admitted again
        self.num_preemptions += 1
        self.add(req)

    def _lpm_key(self, req: Request) -> tuple[int, bool, int, int]:
        """Longest prefix match first (SGLang's lpm: the most prompt tokens already cached),
        within a priority level. A request that has waited `lpm_aging_steps` steps goes
        before every younger one, oldest first, so a prompt nobody shares still runs."""
        if self.num_steps - req.waiting_since_step >= self.config.lpm_aging_steps:
            return (req.priority, False, 0, req.arrival_seq)
        if req.host_block_table:  # swapped out: all its K/V is at hand
            return (req.priority, True, -req.num_computed_tokens, req.arrival_seq)
        return (req.priority, True, -self.kv_cache.num_cached_prefix_tokens(req), req.arrival_seq)

    def _seats_taken(self) -> int:
        """Running sequences and the forks running groups will make once their prompt is
        computed (a group's forks take their seats then)."""
        return len(self.running) + sum(req.num_forks for req in self.running)

    def _admission_order(self) -> list[Request]:
        """The waiting requests in the order they are tried. lpm orders the LPM_WINDOW
        oldest (measuring a request's cached prefix costs a hash lookup per block); the rest
        follow in arrival order."""
        if self.config.policy != "lpm":
            return list(self.waiting)
        window = sorted(self.waiting[:LPM_WINDOW], key=self._lpm_key)
        return window + self.waiting[LPM_WINDOW:]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting or budget == 0 or self._seats_taken() >= self.config.max_num_seqs:
            return
        for req in self._admission_order():
            if budget == 0 or self._seats_taken() + 1 + req.num_forks > self.config.max_num_seqs:
                break
            if req.host_block_table:  # swapped out: resumes where it stopped
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self.kv_cache.swap_in(req, num_new):
                    break
                self._start_running(req, num_new, out)
                budget -= num_new
                continue
            num_cached = self.kv_cache.acquire_cached_prefix(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv_cache.allocate_slots(req, num_new):
                self.kv_cache.free(req)
                break
            if req.session_id is not None:
                # this turn replaces the session (another tenant's stays untouched)
                self.kv_cache.release_session(req.session_id, req.cache_salt)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_cached
                self.prefix_hit_tokens += num_cached
            self._start_running(req, num_new, out)
            budget -= num_new

    def start_forked(self, req: Request) -> None:
        """Run a sequence forked from a running one of its group (it holds its blocks)."""
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.sort_key)

    def _start_running(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.sort_key)
        out.scheduled.append(self._scheduled(req, num_new))

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        samples = req.num_computed_tokens + num_new == req.num_tokens
        logit_rows = num_new if req.wants_prompt_logprobs else int(samples)
        return ScheduledRequest(req, num_new, samples, logit_rows)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Take a request out of the queues and give back (or pin) its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        completed = reason in (FinishReason.STOP, FinishReason.LENGTH)
        if req.session_id is not None and req.pins_session and completed:
            self.kv_cache.pin_session(req)
        else:
            self.kv_cache.free(req)
