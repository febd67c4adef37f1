"""The executor service: the Engine wrapped for the cluster (run by `python -m executor`).

It reads assignments from its Redis inbox (executor/streams.py: on a reader thread while the
engine has work, on the step loop while it is idle), runs the engine's step loop on the main
thread, sends one TokenBatch per step to each gateway on a TokenSink stream
(executor/outbox.py), and publishes a heartbeat every 0.5 s (executor/heartbeat.py). SIGTERM
(or `kvgate admin drain`) drains: no more work is taken, assignments not started go back to
the request stream, and running requests and idle sessions move to peers with their KV
(executor/drain.py); without a peer that takes KV, running work finishes here.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter

import redis

from common.choices import choice_ids, choice_request_id
from common.finish_reason import FinishReason
from common.finish_reason_pb import finish_reason_to_pb
from common.keys import RedisKeys
from common.logs import request_fields
from common.requeue import attempts_used_up
from common.sampling_pb import queued_sampling_params
from engine.engine import Engine
from engine.outputs import RequestOutput
from executor.config import ExecutorConfig
from executor.drain import DrainMoves
from executor.engine_gate import EngineGate
from executor.gateway_link import (
    GatewayAbort,
    GatewayEvent,
    GatewayGone,
    SinkCredentials,
)
from executor.heartbeat import Heartbeat, StatusBoard, executor_status
from executor.metrics import ExecutorMetrics
from executor.outbox import Outbox, Tracked, to_logprobs_pb
from executor.rebalance import SessionMoved, SessionRebalancer
from executor.streams import InboxEntry, InboxReader
from protos.kvgate.v1 import internal_pb2

log = logging.getLogger(__name__)
# How often the step loop refreshes the status the heartbeat publishes, in seconds.
STATUS_INTERVAL_S = 0.1
# How long an idle step loop waits on its inbox before checking for a drain and for gateway
# events, in ms; Redis rounds it up to its 100 ms timer (default hz 10).
IDLE_WAIT_MS = 50


class ExecutorService:
    """Runs the engine's step loop and connects it to Redis and the gateways."""

    def __init__(
        self,
        config: ExecutorConfig,
        engine: Engine,
        client: redis.Redis,
        metrics: ExecutorMetrics | None = None,
        sink_credentials: SinkCredentials | None = None,
    ) -> None:
        keys = RedisKeys(config.redis_prefix)
        self._config = config
        self._engine = engine
        self._metrics = metrics or ExecutorMetrics()
        self._events: queue.SimpleQueue[InboxEntry | GatewayEvent | SessionMoved] = (
            queue.SimpleQueue()
        )
        self._inbox = InboxReader(client, keys, config.executor_id, self._events)
        self._board = StatusBoard()
        self._heartbeat = Heartbeat(client, keys, self._board, config.step_stall_s)
        self._tracked: dict[str, Tracked] = {}  # by request id, or a choice's own id
        self._open_choices: Counter[str] = Counter()  # tracked choices per request of several
        self._runs = itertools.count(1)  # numbers of the admissions (RequestTokens.run)
        credentials = sink_credentials or SinkCredentials()
        self._outbox = Outbox(config.executor_id, self._events.put, credentials)
        self._drain_requested = threading.Event()
        self._taking_work = True
        self._gate = EngineGate()
        self.kv_transfer_address = ""  # set once the KvTransfer service listens
        self._moves: DrainMoves | None = None
        self._rebalancer: SessionRebalancer | None = None
        self._next_status_s = 0.0

    def drain(self) -> None:
        """Finish running work and take no more; safe from a signal handler."""
        self._drain_requested.set()

    def step_loop_check(self) -> str | None:
        """The health condition of the step loop: None while it goes round."""
        return self._heartbeat.stuck_check()

    def draining_check(self) -> str | None:
        """The health condition of a drain: None until one was asked for."""
        if self._drain_requested.is_set():
            return "draining: taking no more work, moving or finishing what it holds"
        return None

    def run(self) -> None:
        """Serves until drained: the step loop on the calling thread. It holds the engine
        gate's lock whenever it touches the engine (KV taken from peers comes in between)."""
        gate = self._gate
        with gate.lock:
            self._post_status()
        self._heartbeat.start()
        self._inbox.start()
        log.info(
            "executor %s serving (%d KV blocks, policy %s)",
            self._config.executor_id,
            self._engine.stats().num_total_blocks,
            self._config.engine.policy,
        )
        while self._taking_work or self._engine.has_unfinished() or not self._events.empty():
            self._board.progress()
            with gate.lock:
                self._stop_taking_work_if_draining()
                self._handle_events()
            if self._taking_work and not self._engine.has_unfinished():
                self._outbox.flush()  # answers due already (a request refused) do not wait for it
                self._inbox.read_while_idle(IDLE_WAIT_MS)
                with gate.lock:
                    self._handle_events()
            # "accepted" entries go out before the step (queue_ms ends here), and before a
            # step that might never end (see _step)
            if self._outbox.flush():
                time.sleep(0)
            gate.busy = self._engine.has_unfinished()
            if gate.busy:
                self._inbox.read_on_thread()
                with gate.lock:
                    self._step()
            with gate.lock:
                gate.run_pending()  # KV coming in from peers, within a budget per step
                if self._rebalancer is not None and self._taking_work:
                    self._rebalancer.tick()
                self._refresh_status()
        self._shut_down()

    def _step(self) -> None:
        """One engine step; its tokens go to the gateways before anything else is done."""
        started = time.perf_counter()
        outputs = self._engine.step()
        step_s = time.perf_counter() - started
        self._publish(outputs)
        if self._outbox.flush():
            # Hand the GIL and the core to the sending threads now: on a busy machine they
            # otherwise wait behind the next step, for milliseconds at times.
            time.sleep(0)
        self._metrics.record_step(step_s, self._engine.stats())

    def _stop_taking_work_if_draining(self) -> None:
        if self._taking_work and self._drain_requested.is_set():
            log.info("draining: %d requests running, taking no more", len(self._tracked))
            self._taking_work = False
            self._post_status()
            self._heartbeat.try_beat()
            self._inbox.hand_back_assignments()
            self._move_out()

    def _move_out(self) -> None:
        """The rest of a drain, when peers take KV (executor/drain.py): each running request
        goes on at the peer that took its KV (its gateway queues it again, pointed there),
        then each idle session moves."""
        moves = self._moves
        if moves is None or not moves.find_peers():
            return
        targets: dict[str, str] = {}  # by the engine's id of the sequence's request
        for moved, target in moves.move_requests():
            request_id = moved.request_id
            if request_id not in self._tracked:  # a choice of a request of several
                request_id = choice_request_id(request_id, moved.index)
            targets[moved.request_id] = target
            self._hand_on(request_id, target)
            self._outbox.flush()
        for request_id, tracked in list(self._tracked.items()):  # choices not forked yet
            self._hand_on(request_id, targets.get(tracked.group_id, ""))
        self._outbox.flush()
        moves.move_sessions()

    def _hand_on(self, request_id: str, target: str) -> None:
        """Tell the request's gateway that it goes on elsewhere (on `target`, which holds
        its KV, when set), and forget it here."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        entry = self._outbox.entry(request_id, tracked)
        entry.moved = True
        entry.moved_to = target
        self._done(tracked)
        log.info(
            "draining: request handed on to %s after %d tokens",
            target or "any executor (recomputed)",
            tracked.offset,
            extra=request_fields(request_id, tracked.session_id),
        )

    def attach_moves(
        self,
        moves: DrainMoves,
        receiver_address: str,
        rebalancer: SessionRebalancer | None = None,
    ) -> None:
        """Move KV to peers on a drain (and, with a rebalancer, idle sessions off a nearly
        full cache), and advertise the KvTransfer service's address."""
        self._moves = moves
        moves.progress = self._board.progress  # a drain's moves keep its heartbeat
        self._rebalancer = rebalancer
        self.kv_transfer_address = receiver_address

    def post_event(self, event: SessionMoved) -> None:
        """Queue an event for the step loop (from another thread)."""
        self._events.put(event)

    @property
    def gate(self) -> EngineGate:
        return self._gate

    def taking_work(self) -> bool:
        return self._taking_work

    def _shut_down(self) -> None:
        self._outbox.flush()
        if self._moves is not None:
            self._moves.close()
        self._outbox.close()
        self._inbox.stop()
        self._heartbeat.stop()
        log.info("executor %s stopped", self._config.executor_id)

    # ---- events: inbox entries and gateway messages -----------------------------------

    def _handle_events(self) -> None:
        """Handles what is on the event queue, without waiting: inbox entries (from either
        reader) and gateway events."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            self._handle(event)

    def _handle(self, event: InboxEntry | GatewayEvent | SessionMoved) -> None:
        if isinstance(event, SessionMoved):
            self._rebalancer.finish(event)
        elif isinstance(event, GatewayAbort):
            self._abort(event.address, event.request_ids, event.attempts, event.runs)
        elif isinstance(event, GatewayGone):
            self._gateway_gone(event.address)
        elif event.message.HasField("assignment") and not self._taking_work:
            self._inbox.hand_back(event.entry_id, event.message.assignment.request)
        elif event.message.HasField("assignment"):
            self._admit(event.message.assignment.request, event.entry_id)
        elif event.message.HasField("drain"):
            log.info("drain asked for by %s", event.message.drain.requested_by or "an operator")
            self._inbox.handled(event.entry_id)
            self.drain()
        else:
            release = event.message.release_session
            self._engine.release_session(release.session_id, release.tenant or None)
            self._inbox.handled(event.entry_id)

    def _admit(self, queued: internal_pb2.QueuedRequest, entry_id: str) -> None:
        """Runs an assignment. Its inbox entry stays until the request is done here
        (finished, refused or aborted), so that if this executor dies, the scheduler hands
        every request it owed back to the queue, also one whose gateway never heard of it."""
        if self._runs_already(queued):
            self._inbox.handled(entry_id)  # a second assignment of a request it runs
            return
        used_up = attempts_used_up(queued)
        if used_up is not None:
            self._reject(queued, used_up)
            self._inbox.handled(entry_id)
            return
        resumed = list(queued.resume_token_ids)
        prompt = list(queued.prompt_token_ids)
        if resumed and len(resumed) >= queued.params.max_tokens:
            self._finish_at_once(queued, FinishReason.LENGTH, "")
            self._inbox.handled(entry_id)
            return
        try:
            self._engine.add_request(
                queued.request_id,
                prompt,
                queued_sampling_params(queued.params),
                priority=queued.priority,
                session_id=queued.session_id or None,
                cache_salt=queued.tenant or None,
                resume_token_ids=resumed,
                choice_index=queued.choice_index,
            )
        except ValueError as error:
            self._reject(queued, str(error))
            self._inbox.handled(entry_id)
            return
        self._track(queued, entry_id)
        log.info(
            "request admitted: %d prompt tokens (%d resumed), attempt %d",
            len(prompt) + len(resumed),
            len(resumed),
            queued.attempt,
            extra=request_fields(queued.request_id, queued.session_id),
        )

    def _runs_already(self, queued: internal_pb2.QueuedRequest) -> bool:
        """Whether it runs the request, or a choice of it, already. The gateway's copy of a
        request or choice queued again alone (with the tokens its client has) replaces a run
        here that started over from fewer (the scheduler queues a lost executor's requests
        and groups again as they were queued): the gateway refuses that run's output, and
        dropping its own copy as a second assignment would leave the client waiting."""
        if queued.request_id in self._open_choices:
            return True
        ids = choice_ids(queued.request_id, queued.params)
        tracked = self._tracked.get(queued.request_id)
        if tracked is not None and len(ids) == 1:
            resumes_further = (
                queued.attempt >= tracked.attempt
                and len(queued.resume_token_ids) > tracked.num_resumed
            )
            if tracked.group_id or resumes_further:
                self._abort(tracked.reply_to, [queued.request_id])
                return False
        return any(request_id in self._tracked for request_id in ids)

    def _track(self, queued: internal_pb2.QueuedRequest, entry_id: str) -> None:
        """Tracks the admitted request, or each of its choices under the choice's own id."""
        ids = choice_ids(queued.request_id, queued.params)
        run = next(self._runs)
        for index, request_id in enumerate(ids):
            tracked = Tracked(
                queued.reply_to,
                len(queued.resume_token_ids),
                queued.tenant,
                list(queued.prompt_token_ids),
                queued.session_id,
                queued.attempt,
                entry_id,
                queued.request_id if len(ids) > 1 else "",
                index if len(ids) > 1 else queued.choice_index,
                run,
                len(queued.resume_token_ids),
            )
            self._tracked[request_id] = tracked
            self._outbox.entry(request_id, tracked).accepted = True
        if len(ids) > 1:
            self._open_choices[queued.request_id] = len(ids)

    def _reject(self, queued: internal_pb2.QueuedRequest, reason: str) -> None:
        log.info(
            "request %s rejected: %s",
            queued.request_id,
            reason,
            extra=request_fields(queued.request_id, queued.session_id),
        )
        self._finish_at_once(queued, FinishReason.ERROR, reason)

    def _finish_at_once(
        self, queued: internal_pb2.QueuedRequest, finish_reason: FinishReason, error_message: str
    ) -> None:
        offset = len(queued.resume_token_ids)
        tracked = Tracked(queued.reply_to, offset, queued.tenant, [], attempt=queued.attempt)
        for index, request_id in enumerate(choice_ids(queued.request_id, queued.params)):
            entry = self._outbox.entry(request_id, tracked)
            entry.index = index or queued.choice_index
            entry.finished = True
            entry.finish_reason = finish_reason_to_pb(finish_reason)
            entry.error_message = error_message

    def _abort(
        self,
        address: str,
        request_ids: list[str],
        attempts: list[int] | None = None,
        runs: list[int] | None = None,
    ) -> None:
        """Stops these requests of the gateway at `address`; with `attempts` (one per id)
        only runs of that attempt or an earlier one, with `runs` only the run of that
        number."""
        for i, request_id in enumerate(request_ids):
            tracked = self._tracked.get(request_id)
            if tracked is None or tracked.reply_to != address:
                continue
            if attempts and tracked.attempt > attempts[i]:
                continue  # a later attempt runs here now
            if runs and tracked.run != runs[i]:
                continue  # another run of the id runs here now
            del self._tracked[request_id]
            if self._done(tracked):  # the request's last choice: all of it
                self._engine.abort(tracked.group_id or request_id)
            else:
                self._engine.abort(request_id)
            log.info(
                "request aborted by its gateway",
                extra=request_fields(request_id, tracked.session_id),
            )
            self._outbox.drop(address, request_id)

    def _done(self, tracked: Tracked) -> bool:
        """Counts a tracked request or choice as done here; True when nothing of its request
        is left, and its inbox entry is deleted then."""
        if tracked.group_id:
            self._open_choices[tracked.group_id] -= 1
            if self._open_choices[tracked.group_id]:
                return False
            del self._open_choices[tracked.group_id]
        self._inbox.handled(tracked.entry_id)
        return True

    def _gateway_gone(self, address: str) -> None:
        self._outbox.forget_gateway(address)
        orphans = [rid for rid, t in self._tracked.items() if t.reply_to == address]
        if orphans:
            log.warning("gateway %s is gone: aborting its %d requests", address, len(orphans))
        self._abort(address, orphans)

    # ---- output: one TokenBatch per gateway per step ------------------------------------

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            request_id = output.request_id
            if request_id not in self._tracked:  # a choice of a request of several
                request_id = choice_request_id(request_id, output.index)
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            entry = self._outbox.entry(request_id, tracked)
            entry.index = output.index
            entry.token_ids.extend(output.new_token_ids)
            entry.logprobs.extend(to_logprobs_pb(output.logprobs or []))
            if output.prompt_logprobs is not None:
                entry.prompt_logprobs.extend(to_logprobs_pb(output.prompt_logprobs))
            entry.num_cached_tokens = output.num_cached_tokens
            tracked.offset += len(output.new_token_ids)
            if output.finished:
                entry.finished = True
                entry.finish_reason = finish_reason_to_pb(output.finish_reason)
                entry.error_message = output.error_message
                del self._tracked[request_id]
                self._done(tracked)
                log.log(
                    logging.WARNING if output.error_message else logging.INFO,
                    "request finished: %s, %d cached prompt tokens%s",
                    output.finish_reason,
                    output.num_cached_tokens,
                    f" ({output.error_message})" if output.error_message else "",
                    extra=request_fields(request_id, tracked.session_id),
                )

    # ---- status -------------------------------------------------------------------------

    def _refresh_status(self) -> None:
        if time.monotonic() >= self._next_status_s:
            self._post_status()

    def _post_status(self) -> None:
        self._next_status_s = time.monotonic() + STATUS_INTERVAL_S
        stats = self._engine.stats()
        self._metrics.record_stats(stats)
        draining, address = not self._taking_work, self.kv_transfer_address
        self._board.post(executor_status(self._config, self._engine, stats, draining, address))
