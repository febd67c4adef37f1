"""The in-process engine: add requests, step, read tokens. No Redis, no gRPC.

engine = Engine(EngineConfig(model="../shared/models/stories260K"))
engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32, temperature=0))
while engine.has_unfinished():
    for output in engine.step():
        ...
"""

from __future__ import annotations

import itertools

import torch

from common.choices import choice_request_id, split_choice_request_id
from common.finish_reason import FinishReason
from common.sampling_params import SamplingParams, choice_seed
from engine.config import EngineConfig
from engine.draft import DraftProposer
from engine.groups import Sequences, check_group
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, RequestOutput
from engine.prompt_logprobs import record_prompt_logprobs, take_prompt_logprobs
from engine.request import Request
from engine.request_checks import RequestChecks
from engine.sampler import Sampler, SamplingBatch
from engine.speculative import Accepted, NgramProposer, Verifier
from engine.step_scheduler import ScheduledRequest, SchedulerOutput, StepScheduler
from engine.structured import StructuredOutput, advance

# How long a step with nothing to run waits for a grammar being compiled.
COMPILE_WAIT_S = 0.01


NO_ALLOWED_TOKEN = (
    "no token is allowed next: the constraint, allowed_token_ids, logit_bias and min_tokens "
    "together leave none"
)


class Engine:
    """Continuous batching over a paged KV cache, driven by `step()`; see the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            session_ttl_s=config.session_ttl_s,
            num_host_blocks=self.runner.num_host_blocks,
            # the other ranks do not see block copies: forks recompute their partial block
            copy_on_write=config.tensor_parallel_size == 1,
        )
        self.scheduler = StepScheduler(config, self.kv_cache, self.max_model_len)
        self.sampler = Sampler(
            list(self.model_config.eos_token_ids), self.runner.device, self.runner.kernels.argmax
        )
        self.structured = StructuredOutput.for_model(
            config.model, self.model_config.vocab_size, list(self.model_config.eos_token_ids)
        )
        self.verifier = Verifier(self.kv_cache, self.sampler, self.model_config.vocab_size)
        self.proposer = self._proposer(config)
        self.requests = Sequences()
        self.checks = RequestChecks(self.max_model_len, self.model_config.vocab_size, self.requests)
        self._arrivals = itertools.count()

    def _proposer(self, config: EngineConfig) -> NgramProposer | DraftProposer | None:
        spec, eos_token_ids = config.speculative_config, list(self.model_config.eos_token_ids)
        if spec is None:
            return None
        if spec.method == "draft_model":
            num_blocks = self.runner.num_blocks
            return DraftProposer(spec, config, self.max_model_len, eos_token_ids, num_blocks)
        return NgramProposer(spec, self.max_model_len, eos_token_ids)

    # ---- API ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        session_id: str | None = None,
        cache_salt: str | None = None,
        resume_token_ids: list[int] | None = None,
        choice_index: int = 0,
    ) -> None:
        """Queue a request; it runs from the next `step()`.

        A request with `params.num_sequences` > 1 (n, best_of) is a sequence group: its prompt
        is prefilled once, then it forks into that many sequences sharing the prompt's blocks
        (see engine/kv_cache.py), each sampled on its own and reported with its `index`.
        Choice 0 alone keeps the session's blocks.

        Args:
            resume_token_ids: output an earlier run of the request produced (on an executor
                that went away): prefilled after the prompt and counted as output, so
                max_tokens, min_tokens and the penalties see them, and a seeded request's
                generator continues past their draws: the whole output equals one
                undisturbed run. A constraint's matcher replays them too.
            choice_index: the choice a one-sequence request runs (a choice of a group run
                again alone): its outputs carry it, and its seed is that choice's.

        A request with a constraint whose grammar is not compiled yet (see
        engine/structured.py) compiles off the step loop and runs from the step after;
        if it does not compile, a later step finishes it with FinishReason.ERROR.

        Raises:
            ValueError: a field is invalid (the message names it), or the id is in use.
        """
        self.checks.request(request_id, prompt_token_ids, params, priority, session_id, cache_salt)
        check_group(params, resume_token_ids, choice_index, self.config.max_num_seqs)
        resumed = list(resume_token_ids or [])
        tokens = list(prompt_token_ids) + resumed
        if resumed:
            self.checks.prompt(tokens)
        req = Request(
            request_id=request_id,  # a group's first sequence: choice 0's id once it forks
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_seq=next(self._arrivals),
            priority=priority,
            session_id=session_id,
            cache_salt=cache_salt,
            generator=self._generator(params, choice_index, len(resumed)),
            all_token_ids=tokens,
            group_id=request_id,
            index=choice_index,
            num_forks=params.num_sequences - 1,
        )
        if params.constraint is None or self.structured.start(req, resumed):
            self.scheduler.add(req)
        self.requests.add(req)

    def abort(self, request_id: str) -> None:
        """Stop a request (every sequence of a group), or one choice of a group by its own
        id (common.choices), and free its blocks; it produces no further output. An id some
        sequence has names that sequence: a choice run alone under its own id is not taken
        for that choice of its group.

        Raises:
            ValueError: no unfinished request or choice has this id.
        """
        req = self.requests.get(request_id)  # a sequence, a choice run alone, or a group unforked
        leader = None if req is not None else self.requests.leader_of(request_id)
        if leader is not None:  # a choice not forked yet (or the one that forks): it never starts
            leader.unwanted_choices.add(split_choice_request_id(request_id)[1])
            return
        sequences = [req] if req is not None else self.requests.of_request(request_id)
        if not sequences:
            raise ValueError(f"request_id {request_id!r} is not a running or waiting request")
        for seq in sequences:
            self.requests.remove(seq)
            if not self.structured.cancel(seq.request_id):
                self.scheduler.finish(seq, FinishReason.ABORT)

    def step(self) -> list[RequestOutput]:
        """Run one forward pass over the current batch.

        Returns:
            One output per request that produced a token this step (requests in the middle
            of a chunked prefill produce none). Aborted requests never appear.
        """
        self.kv_cache.expire_sessions()
        refused = self._take_compiled()
        proposals = self.proposer.propose(self.scheduler.running) if self.proposer else {}
        out = self.scheduler.schedule(proposals)
        self.runner.swap_blocks(self.kv_cache.host.take_ops())
        if out.is_empty:
            self.structured.wait(COMPILE_WAIT_S)
            return refused
        try:
            logits = self.runner.execute(out)
        except Exception as error:  # noqa: BLE001 (any failure of the model: isolate it)
            return refused + self._run_each_alone(out, error)
        return refused + self._update(out, logits)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits of a whole sequence in one forward pass: row i holds the
        model's float32 logits for the token after token_ids[: i + 1]. For measuring a model's
        quality (bench/quality.py); it needs an idle engine, takes blocks as a request would
        (evicting cached prefixes if it must) and gives them back.

        Raises:
            ValueError: the ids are not a valid prompt for this model.
            RuntimeError: requests are running or waiting, or the KV cache cannot hold it.
        """
        if self.requests:
            raise RuntimeError("prompt_logits needs an idle engine (requests are in flight)")
        self.checks.prompt(token_ids)
        req = Request("prompt-logits", list(token_ids), SamplingParams(max_tokens=1), -1)
        if not self.kv_cache.allocate_slots(req, len(token_ids)):
            raise RuntimeError(f"the KV cache cannot hold {len(token_ids)} tokens at once")
        self.runner.swap_blocks(self.kv_cache.host.take_ops())  # sessions it moved out
        try:
            step = ScheduledRequest(req, len(token_ids), samples=True)
            return self.runner.execute(SchedulerOutput([step], len(token_ids)), every_row=True)
        finally:
            self.kv_cache.free(req)

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (with one rank there is nothing to
        stop); the engine cannot step afterwards."""
        self.runner.close()
        self.structured.close()

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self.requests)

    def release_session(self, session_id: str, cache_salt: str | None = None) -> bool:
        """End the session of the tenant `cache_salt` here: unpin its blocks, and have its
        requests still waiting or running free theirs when they finish instead of pinning
        them (a turn that finishes after its session ended must not bring it back).

        Returns:
            False when the engine holds no such session for that tenant.
        """
        for req in self.requests:
            if req.session_id == session_id and req.cache_salt == cache_salt:
                req.pins_session = False
        return self.kv_cache.release_session(session_id, cache_salt)

    def num_available_blocks(self) -> int:
        """KV blocks free now or held only by idle sessions, which give them up on demand."""
        return self.kv_cache.num_available_blocks()

    def session_ids(self) -> list[str]:
        """Sessions whose blocks this engine holds now (on the device or in the host tier)."""
        return self.kv_cache.session_ids()

    def cached_block_hashes(self, limit: int) -> list[int]:
        """Prefix-cache hashes (`common.prefix` scheme) of up to `limit` blocks, newest first."""
        return self.kv_cache.cached_block_hashes(limit)

    def stats(self) -> EngineStats:
        """Queue lengths, block usage and cumulative cache and preemption counters."""
        kv, host, spec = self.kv_cache, self.kv_cache.host, self.verifier.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.structured.num_compiling,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            num_session_pins=len(kv.sessions),
            num_session_blocks=kv.num_session_blocks(),
            num_preemptions=self.scheduler.num_preemptions,
            num_evicted_blocks=kv.num_evicted_blocks,
            num_evicted_sessions=kv.num_evicted_sessions,
            num_batched_tokens=self.scheduler.num_batched_tokens,
            num_host_blocks_total=host.num_blocks,
            num_host_blocks_used=host.num_blocks - host.num_free_blocks,
            num_swapped_out_blocks=host.num_swapped_out_blocks,
            num_swapped_in_blocks=host.num_swapped_in_blocks,
            num_offloaded_sessions=kv.num_offloaded_sessions,
            spec_method="" if self.proposer is None else self.proposer.config.method,
            num_spec_drafts=spec.num_drafts,
            num_spec_proposed_tokens=spec.num_proposed_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens,
            num_spec_bonus_tokens=spec.num_bonus_tokens,
        )

    # ---- step internals -----------------------------------------------------------------

    def _update(self, out: SchedulerOutput, logits) -> list[RequestOutput]:
        sample_rows, end = [], 0  # the logits row each sampling request samples from
        for s in out.scheduled:
            end += s.logit_rows
            if s.request.wants_prompt_logprobs:
                record_prompt_logprobs(s, logits[end - s.logit_rows : end])
            if s.samples:  # its last row, and one before it per proposed token
                sample_rows.extend(range(end - 1 - len(s.spec_token_ids), end))
            s.request.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            self.kv_cache.register_computed_blocks(s.request)
        sampling, rows = self._with_forks([s for s in out.scheduled if s.samples])
        if not sampling:
            return []
        rows = [sample_rows[row] for row in rows]
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        draws = self.verifier.draws_before(sampling)
        sampled = self.sampler(logits, self._sampling_batch(sampling))
        outputs, first_row = [], 0
        for req, proposed in sampling:
            tokens = self.verifier.accepted(req, proposed, sampled, first_row)
            self.verifier.rewind(req, draws, len(tokens.token_ids))
            outputs += self._take(req, proposed, tokens)
            first_row += 1 + len(proposed)
        return outputs

    def _take(self, req: Request, proposed: list[int], tokens: Accepted) -> list[RequestOutput]:
        """Append the tokens a request's rows sampled (its one, or its verified proposals
        and the target's next), roll its KV back to them, and report them."""
        reason, failure = None, ""
        for i, token_id in enumerate(tokens.token_ids):
            req.all_token_ids.append(token_id)
            reason = self._finish_reason(req, token_id)
            if reason is None and (problem := advance(req, token_id)) is not None:
                failure = problem
                del tokens.token_ids[i:], tokens.logprobs[i:]
                break
            if reason is not None:
                del tokens.token_ids[i + 1 :], tokens.logprobs[i + 1 :]
                break
        if proposed:
            self.verifier.roll_back(req, proposed, tokens.token_ids)
        outputs = []
        ends_blocked = tokens.blocked and reason is None and not failure
        if tokens.token_ids:  # before an end: the tokens the steps before it gave
            outputs.append(self._output(req, tokens, None if failure else reason))
        if failure:
            return outputs + self._fail_with(req, failure)
        if ends_blocked:
            return outputs + self._end_blocked(req)
        if reason is not None:
            self.requests.remove(req)
            self.scheduler.finish(req, reason)
        return outputs

    def _output(self, req: Request, tokens: Accepted, reason: FinishReason | None) -> RequestOutput:
        return RequestOutput(
            request_id=req.group_id,
            new_token_ids=tokens.token_ids,
            logprobs=None if req.params.logprobs is None else tokens.logprobs,
            finished=reason is not None,
            finish_reason=reason,
            num_cached_tokens=req.num_cached_tokens or 0,
            index=req.index,
            prompt_logprobs=take_prompt_logprobs(req),
        )

    # ---- sequence groups ----------------------------------------------------------------

    def _with_forks(
        self, sampling: list[ScheduledRequest]
    ) -> tuple[list[tuple[Request, list[int]]], list[int]]:
        """The sequences that sample this step with the tokens proposed for each, and the
        logits rows of their positions: a group whose prompt was just computed forks here,
        every new sequence sampling from its row."""
        seqs: list[tuple[Request, list[int]]] = []
        rows: list[int] = []
        first_row = 0
        for s in sampling:
            req, num_rows = s.request, 1 + len(s.spec_token_ids)
            family = self._fork(req) if req.num_forks else [req]
            seqs += [(seq, s.spec_token_ids) for seq in family]
            for _ in family:
                rows += range(first_row, first_row + num_rows)
            first_row += num_rows
        return seqs, rows

    def _fork(self, leader: Request) -> list[Request]:
        """The group's sequences: `leader` and its forks, those aborted before left out."""
        indexes = range(leader.index + 1, leader.index + 1 + leader.num_forks)
        family = [self._child(leader, i) for i in indexes if i not in leader.unwanted_choices]
        leader.num_forks = 0
        if leader.index in leader.unwanted_choices:
            self.requests.remove(leader)
            self.scheduler.finish(leader, FinishReason.ABORT)
            return family
        self.requests.rename(leader, choice_request_id(leader.group_id, leader.index))
        return [leader, *family]

    def _child(self, leader: Request, index: int) -> Request:
        child = Request(
            request_id=choice_request_id(leader.group_id, index),
            prompt_token_ids=leader.prompt_token_ids,
            params=leader.params,
            arrival_seq=leader.arrival_seq,
            priority=leader.priority,
            cache_salt=leader.cache_salt,
            generator=self._generator(leader.params, index, 0),
            matcher=None if leader.matcher is None else leader.matcher.deep_copy(),
            all_token_ids=list(leader.all_token_ids),
            prompt_logprobs=list(leader.prompt_logprobs),
            num_cached_tokens=leader.num_cached_tokens,
            group_id=leader.group_id,
            index=index,
        )
        self.kv_cache.fork(leader, child)
        self.scheduler.start_forked(child)
        self.requests.add(child)
        return child

    def _generator(
        self, params: SamplingParams, index: int, num_resumed: int
    ) -> torch.Generator | None:
        """The generator of choice `index` of a seeded request (None unseeded), past the
        draws of `num_resumed` tokens."""
        if params.seed is None:
            return None
        generator = Sampler.make_generator(choice_seed(params.seed, index), self.runner.device)
        if not params.is_greedy:
            self.sampler.skip_draws(generator, num_resumed, self.model_config.vocab_size)
        return generator

    def _run_each_alone(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """After a failed forward pass, runs each of its requests alone, once: those that
        fail alone too finish with FinishReason.ERROR, the others go on as if the step had
        worked (their K/V is written again at the same slots)."""
        if len(out.scheduled) == 1:
            return self._fail([out.scheduled[0].request], error)
        passed, rows, failed = [], [], []
        for scheduled in out.scheduled:
            alone = SchedulerOutput([scheduled], scheduled.num_new_tokens)
            try:
                rows.append(self.runner.execute(alone))
                passed.append(scheduled)
            except Exception as alone_error:  # noqa: BLE001
                failed.append((scheduled.request, alone_error))
        outputs = [o for req, e in failed for o in self._fail([req], e)]
        if passed:
            batch = SchedulerOutput(passed, sum(s.num_new_tokens for s in passed))
            outputs += self._update(batch, torch.cat(rows))
        return outputs

    def _fail(self, reqs: list[Request], error: Exception) -> list[RequestOutput]:
        """Finishes `reqs` with FinishReason.ERROR and a message naming the error."""
        message = f"the model step failed: {type(error).__name__}: {error}"
        return [output for req in reqs for output in self._fail_with(req, message)]

    def _fail_with(self, req: Request, message: str, scheduled: bool = True) -> list[RequestOutput]:
        """Finishes `req` with FinishReason.ERROR and `message` (`scheduled`: it was handed
        to the step scheduler, which gives back its blocks)."""
        self.requests.remove(req)
        if scheduled:
            self.scheduler.finish(req, FinishReason.ERROR)
        indexes = range(req.index, req.index + 1 + req.num_forks)  # forks it never made too
        return [
            RequestOutput(req.group_id, [], None, True, FinishReason.ERROR,
                          req.num_cached_tokens or 0, message, index)
            for index in indexes if index not in req.unwanted_choices
        ]  # fmt: skip

    def _end_blocked(self, req: Request) -> list[RequestOutput]:
        """Ends a request left with no token to sample: with FinishReason.STOP when its
        constraint is complete (min_tokens masked the end-of-sequence it allows, as it
        would a stop token), else with FinishReason.ERROR."""
        if req.matcher is None or not req.matcher.is_accepting():
            return self._fail_with(req, NO_ALLOWED_TOKEN)
        self.requests.remove(req)
        self.scheduler.finish(req, FinishReason.STOP)
        cached = req.num_cached_tokens or 0
        prompt_logprobs = take_prompt_logprobs(req)  # a constraint complete at once
        return [
            RequestOutput(req.group_id, [], None, True, FinishReason.STOP, cached,
                          index=req.index, prompt_logprobs=prompt_logprobs)
        ]  # fmt: skip

    def _take_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar compiled since the last step; finish those
        whose grammar did not compile."""
        ready, failed = self.structured.take_ready()
        for req in ready:
            self.scheduler.add(req)
        return [o for f in failed for o in self._fail_with(f.request, f.message, scheduled=False)]

    def _sampling_batch(self, sampling: list[tuple[Request, list[int]]]) -> SamplingBatch:
        """One row per sampled position: a request verifying proposals has a row per
        proposed token more, each seeing the proposals before it as produced."""
        rows = [(req, proposed[:j]) for req, proposed in sampling
                for j in range(1 + len(proposed))]  # fmt: skip
        reqs = [req for req, _ in rows]
        return SamplingBatch(
            params=[r.params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids + ahead for r, ahead in rows],
            generators=[r.generator for r in reqs],
            token_bitmask=self.structured.bitmask(reqs, [ahead for _, ahead in rows]),
            draft_probs=self._draft_probs(sampling),
        )

    def _draft_probs(
        self, sampling: list[tuple[Request, list[int]]]
    ) -> list[tuple[int, torch.Tensor] | None] | None:
        """SamplingBatch.draft_probs: the draft's q of each proposal it sampled (see
        engine/draft.py); None when no row verifies one."""
        drafted = getattr(self.proposer, "draft_probs", None)
        if not drafted:
            return None
        rows: list[tuple[int, torch.Tensor] | None] = []
        for req, proposed in sampling:
            q = drafted.get(req.request_id)
            rows += [None if q is None else (token, q[j]) for j, token in enumerate(proposed)]
            rows.append(None)  # the row after the proposals samples as usual
        return rows

    def _finish_reason(self, req: Request, token_id: int) -> FinishReason | None:
        params = req.params
        if req.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token_id in self.model_config.eos_token_ids:
                return FinishReason.STOP
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
