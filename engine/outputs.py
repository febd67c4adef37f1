"""What the engine reports: a request's tokens of one step, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass

from common.finish_reason import FinishReason
from engine.sampler import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced this step
    logprobs: list[TokenLogprobs] | None  # one per new token, when the request asked for them
    finished: bool
    # STOP, LENGTH, or ERROR (its model step failed) once finished; aborts produce no output
    finish_reason: FinishReason | None
    num_cached_tokens: int  # prompt tokens served from the prefix or session cache
    error_message: str = ""  # what failed, with FinishReason.ERROR
    index: int = 0  # the choice (SamplingParams.n, best_of) these tokens belong to
    # SamplingParams.prompt_logprobs, with the first output: entry p is prompt token p + 1's
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int  # waiting for blocks or a batch slot, or for their grammar to compile
    num_free_blocks: int
    num_total_blocks: int
    prefix_hit_tokens: int  # cumulative prompt tokens served from the cache
    num_session_pins: int  # sessions holding blocks now
    num_session_blocks: int  # blocks those sessions hold
    num_preemptions: int  # cumulative
    num_evicted_blocks: int  # cumulative cached blocks reused for new data
    num_evicted_sessions: int  # cumulative sessions dropped under memory pressure
    num_batched_tokens: int  # cumulative tokens run through the model (prompt chunks and decodes)
    num_host_blocks_total: int  # blocks of the host tier (0: none)
    num_host_blocks_used: int  # held by swapped-out requests and offloaded sessions
    num_swapped_out_blocks: int  # cumulative blocks copied from the device to the host tier
    num_swapped_in_blocks: int  # cumulative blocks copied back to the device
    num_offloaded_sessions: int  # cumulative sessions moved to the host tier under pressure
    # speculative decoding (engine/speculative.py), cumulative
    spec_method: str  # the proposer's method; empty: no speculation
    num_spec_drafts: int  # steps in which a request verified proposed tokens
    num_spec_proposed_tokens: int
    num_spec_accepted_tokens: int  # proposed tokens the target agreed with
    num_spec_bonus_tokens: int  # the target's token after a fully accepted proposal

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying step gives a request on average: its accepted proposed tokens
        and the target's own one (vLLM's mean acceptance length); 0 before the first draft."""
        if not self.num_spec_drafts:
            return 0.0
        return 1 + self.num_spec_accepted_tokens / self.num_spec_drafts
