"""The executor process: the Engine wrapped for the cluster.

`python -m executor --model DIR`: reads assignments from its Redis
inbox (on a reader thread while the engine has work, on the step loop while it
is idle), runs the engine's step loop on the main thread, sends
one TokenBatch per step to each gateway on a TokenSink stream, and publishes a
heartbeat every 0.5 s. SIGTERM drains: running work finishes, no more is taken,
and assignments still unread in the inbox go back to the request stream.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from common.config import (
    DEFAULT_MODEL,
    DEFAULT_REDIS_URL,
    add_common_flags,
    check_common_fields,
    check_range,
    env_bool,
    env_float,
    env_int,
    env_str,
)
from common.keys import RedisKeys
from common.logs import add_log_context, request_fields
from common.metrics import add_metrics_flags, check_metrics_port
from common.redis_conn import connect_sync
from common.sampling_pb import resumed_sampling_params
from common.startup import start_process
from executor.config import EngineConfig, check_device_present
from executor.engine import Engine, RequestOutput
from executor.gateway_link import GatewayAbort, GatewayEvent, GatewayGone, GatewayLink
from executor.metrics import ExecutorMetrics
from executor.redis_io import (
    Heartbeat,
    InboxEntry,
    InboxReader,
    StatusBoard,
    another_executor_has_the_id,
)
from executor.sampler import TokenLogprobs
from protos.kvgate.v1 import inference_pb2, internal_pb2

log = logging.getLogger(__name__)
# How often the step loop refreshes the status the heartbeat publishes, in seconds.
STATUS_INTERVAL_S = 0.1
# Longest time a thread holding the GIL keeps it while another thread asks for it, in seconds.
GIL_SWITCH_INTERVAL_S = 0.0002
# How long an idle step loop waits on its inbox before checking for a drain and for gateway
# events, in ms; Redis rounds it up to its 100 ms timer (default hz 10).
IDLE_WAIT_MS = 50
# Most prefix-cache block hashes reported in a heartbeat.
MAX_REPORTED_HASHES = 1024
FINISH_REASONS = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "abort": inference_pb2.FINISH_REASON_ABORT,
}


@dataclass(slots=True)
class ExecutorServiceConfig:
    """What the executor process needs; validated in `__post_init__` (errors name the flag)."""

    model: str
    redis_url: str = DEFAULT_REDIS_URL
    redis_prefix: str = "kvgate:"
    log_level: str = "info"
    log_format: str = "json"
    executor_id: str = ""  # empty: host-pid
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    kv_cache_gib: float = 1.0
    num_gpu_blocks: int = 0  # 0: sized from kv_cache_gib or gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    session_ttl_s: float = 600.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: a free port, -1: no metrics
    torch_threads: int = 0  # CPU threads for the model; 0: torch's default (all cores)
    dtype: str = ""  # empty: float32 on the CPU, bfloat16 on CUDA
    quantization: str = "none"  # weight-only: none, int8, int4
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    retain_freed_memory: bool = True  # CPU: keep freed activations in the process for reuse
    engine: EngineConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_common_fields(self.redis_url, self.log_level, self.log_format)
        check_metrics_port(self.metrics_port)
        check_range("--torch-threads", self.torch_threads, min_value=0, max_value=1024)
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model must be a model folder with config.json, got {self.model!r}")
        if any(c.isspace() or c == ":" for c in self.executor_id):
            raise ValueError(f"--executor-id must hold no spaces or ':', got {self.executor_id!r}")
        self.executor_id = self.executor_id or f"{socket.gethostname()}-{os.getpid()}"
        self.engine = self._engine_config()
        check_device_present(self.device)

    def _engine_config(self) -> EngineConfig:
        try:
            return EngineConfig(
                model=self.model,
                block_size=self.block_size,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len or None,
                kv_cache_gib=self.kv_cache_gib,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks=self.num_gpu_blocks or None,
                session_ttl_s=self.session_ttl_s,
                device=self.device,
                retain_freed_memory=self.retain_freed_memory,
                dtype=self.dtype or None,
                quantization=self.quantization,
                enforce_eager=self.enforce_eager,
            )
        except ValueError as error:
            name, _, rest = str(error).partition(" ")
            raise ValueError(f"--{name.replace('_', '-')} {rest}") from None

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> ExecutorServiceConfig:
        """Args: command-line flags (None: sys.argv). Returns: the validated config."""
        parser = argparse.ArgumentParser(prog="python -m executor", description=__doc__)
        add_common_flags(parser)
        add = parser.add_argument
        add(
            "--model",
            default=env_str("KVGATE_MODEL", DEFAULT_MODEL),
            help="model folder (KVGATE_MODEL)",
        )
        add("--executor-id", default=env_str("KVGATE_EXECUTOR_ID", ""))
        add("--device", default=env_str("KVGATE_DEVICE", "cpu"))
        add("--block-size", type=int, default=env_int("KVGATE_BLOCK_SIZE", 16))
        add("--max-num-seqs", type=int, default=env_int("KVGATE_MAX_NUM_SEQS", 64))
        add(
            "--max-num-batched-tokens",
            type=int,
            default=env_int("KVGATE_MAX_NUM_BATCHED_TOKENS", 2048),
        )
        add("--max-model-len", type=int, default=env_int("KVGATE_MAX_MODEL_LEN", 0))
        add("--kv-cache-gib", type=float, default=env_float("KVGATE_KV_CACHE_GIB", 1.0))
        add("--num-gpu-blocks", type=int, default=env_int("KVGATE_NUM_GPU_BLOCKS", 0))
        add(
            "--gpu-memory-utilization",
            type=float,
            default=env_float("KVGATE_GPU_MEMORY_UTILIZATION", 0.9),
        )
        add("--session-ttl-s", type=float, default=env_float("KVGATE_SESSION_TTL_S", 600.0))
        threads_help = "CPU threads for the model (0: all cores)"
        add(
            "--torch-threads",
            type=int,
            default=env_int("KVGATE_TORCH_THREADS", 0),
            help=threads_help,
        )
        add(
            "--retain-freed-memory",
            action=argparse.BooleanOptionalAction,
            default=env_bool("KVGATE_RETAIN_FREED_MEMORY", True),
            help="CPU: keep freed activation memory in the process for reuse (glibc)",
        )
        add("--dtype", default=env_str("KVGATE_DTYPE", ""), help="default: float32 CPU, bf16 CUDA")
        add("--quantization", default=env_str("KVGATE_QUANTIZATION", "none"), help="int8, int4")
        add("--enforce-eager", action="store_true", default=env_bool("KVGATE_ENFORCE_EAGER", False))
        add_metrics_flags(parser, "KVGATE_EXECUTOR_METRICS_PORT")
        return cls(**vars(parser.parse_args(argv)))


@dataclass(slots=True)
class Tracked:
    """A request this executor runs, and where its tokens go."""

    reply_to: str  # TokenSink address of its gateway
    offset: int  # index in the completion of its next token
    tenant: str
    prompt_token_ids: list[int]
    session_id: str = ""  # empty: no session


def to_logprobs_pb(logprobs: list[TokenLogprobs]) -> list[inference_pb2.TokenLogprob]:
    """Returns: the engine's logprobs as protobuf messages."""
    return [
        inference_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


class ExecutorService:
    """Runs the engine's step loop and connects it to Redis and the gateways."""

    def __init__(
        self,
        config: ExecutorServiceConfig,
        engine: Engine,
        client: redis.Redis,
        metrics: ExecutorMetrics | None = None,
    ) -> None:
        keys = RedisKeys(config.redis_prefix)
        self._config = config
        self._engine = engine
        self._metrics = metrics or ExecutorMetrics()
        self._events: queue.SimpleQueue[InboxEntry | GatewayEvent] = queue.SimpleQueue()
        self._inbox = InboxReader(client, keys, config.executor_id, self._events)
        self._board = StatusBoard()
        self._heartbeat = Heartbeat(client, keys, self._board)
        self._links: dict[str, GatewayLink] = {}
        self._tracked: dict[str, Tracked] = {}
        self._outbox: dict[str, dict[str, internal_pb2.RequestTokens]] = {}
        self._drain_requested = threading.Event()
        self._taking_work = True
        self._next_status_s = 0.0

    def drain(self) -> None:
        """Finish running work and take no more; safe from a signal handler."""
        self._drain_requested.set()

    def run(self) -> None:
        """Serves until drained: the step loop on the calling thread."""
        self._post_status()
        self._heartbeat.start()
        self._inbox.start()
        log.info(
            "executor %s serving (%d KV blocks)",
            self._config.executor_id,
            self._engine.stats().num_total_blocks,
        )
        while self._taking_work or self._engine.has_unfinished() or not self._events.empty():
            self._stop_taking_work_if_draining()
            self._handle_events()
            if self._taking_work and not self._engine.has_unfinished():
                self._flush()  # answers due already (a request refused) do not wait for it
                self._inbox.read_while_idle(IDLE_WAIT_MS)
                self._handle_events()
            self._flush()  # "accepted" entries go out before the step: queue_ms ends here
            if self._engine.has_unfinished():
                self._inbox.read_on_thread()
                self._step()
            self._refresh_status()
        self._shut_down()

    def _step(self) -> None:
        """One engine step; its tokens go to the gateways before anything else is done."""
        started = time.perf_counter()
        outputs = self._engine.step()
        step_s = time.perf_counter() - started
        self._publish(outputs)
        if self._flush():
            # Hand the GIL and the core to the sending threads now: on a busy machine they
            # otherwise wait behind the next step, for milliseconds at times.
            time.sleep(0)
        self._metrics.record_step(step_s, self._engine.stats())

    def _stop_taking_work_if_draining(self) -> None:
        if self._taking_work and self._drain_requested.is_set():
            log.info("draining: finishing %d requests, taking no more", len(self._tracked))
            self._taking_work = False
            self._post_status()
            self._heartbeat.try_beat()
            self._inbox.hand_back_assignments()

    def _shut_down(self) -> None:
        self._flush()
        for link in self._links.values():
            link.close()
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

    def _handle(self, event: InboxEntry | GatewayEvent) -> None:
        if isinstance(event, GatewayAbort):
            self._abort(event.address, event.request_ids)
        elif isinstance(event, GatewayGone):
            self._gateway_gone(event.address)
        elif event.message.HasField("assignment"):
            self._admit(event.message.assignment.request)
            self._inbox.handled(event.entry_id)
        else:
            release = event.message.release_session
            self._engine.release_session(release.session_id, release.tenant or None)
            self._inbox.handled(event.entry_id)

    def _admit(self, queued: internal_pb2.QueuedRequest) -> None:
        if queued.request_id in self._tracked:
            return
        resumed = list(queued.resume_token_ids)
        prompt = list(queued.prompt_token_ids) + resumed
        if resumed and len(resumed) >= queued.params.max_tokens:
            self._finish_at_once(queued, inference_pb2.FINISH_REASON_LENGTH, "")
            return
        try:
            params = resumed_sampling_params(queued.params, len(resumed))
            self._engine.add_request(
                queued.request_id,
                prompt,
                params,
                priority=queued.priority,
                session_id=queued.session_id or None,
                cache_salt=queued.tenant or None,
            )
        except ValueError as error:
            self._reject(queued, str(error))
            return
        tracked = Tracked(queued.reply_to, len(resumed), queued.tenant, prompt, queued.session_id)
        self._tracked[queued.request_id] = tracked
        self._entry(queued.request_id, tracked)
        log.info(
            "request admitted: %d prompt tokens (%d resumed), attempt %d",
            len(prompt),
            len(resumed),
            queued.attempt,
            extra=request_fields(queued.request_id, queued.session_id),
        )

    def _reject(self, queued: internal_pb2.QueuedRequest, reason: str) -> None:
        log.info(
            "request %s rejected: %s",
            queued.request_id,
            reason,
            extra=request_fields(queued.request_id, queued.session_id),
        )
        self._finish_at_once(queued, inference_pb2.FINISH_REASON_ERROR, reason)

    def _finish_at_once(
        self, queued: internal_pb2.QueuedRequest, finish_reason: int, error_message: str
    ) -> None:
        offset = len(queued.resume_token_ids)
        entry = self._entry(queued.request_id, Tracked(queued.reply_to, offset, queued.tenant, []))
        entry.finished = True
        entry.finish_reason = finish_reason
        entry.error_message = error_message

    def _abort(self, address: str, request_ids: list[str]) -> None:
        for request_id in request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is None or tracked.reply_to != address:
                continue
            self._engine.abort(request_id)
            del self._tracked[request_id]
            log.info(
                "request aborted by its gateway",
                extra=request_fields(request_id, tracked.session_id),
            )
            self._outbox.get(address, {}).pop(request_id, None)

    def _gateway_gone(self, address: str) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.close()
        orphans = [rid for rid, t in self._tracked.items() if t.reply_to == address]
        if orphans:
            log.warning("gateway %s is gone: aborting its %d requests", address, len(orphans))
        self._abort(address, orphans)
        self._outbox.pop(address, None)

    # ---- output: one TokenBatch per gateway per step ------------------------------------

    def _entry(self, request_id: str, tracked: Tracked) -> internal_pb2.RequestTokens:
        entries = self._outbox.setdefault(tracked.reply_to, {})
        entry = entries.get(request_id)
        if entry is None:
            entry = internal_pb2.RequestTokens(request_id=request_id, offset=tracked.offset)
            entries[request_id] = entry
        return entry

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            entry = self._entry(output.request_id, tracked)
            entry.token_ids.extend(output.new_token_ids)
            entry.logprobs.extend(to_logprobs_pb(output.logprobs or []))
            entry.num_cached_tokens = output.num_cached_tokens
            tracked.offset += len(output.new_token_ids)
            if output.finished:
                entry.finished = True
                entry.finish_reason = FINISH_REASONS[output.finish_reason or "stop"]
                del self._tracked[output.request_id]
                log.info(
                    "request finished: %s, %d cached prompt tokens",
                    output.finish_reason,
                    output.num_cached_tokens,
                    extra=request_fields(output.request_id, tracked.session_id),
                )

    def _flush(self) -> bool:
        """Sends one TokenBatch per gateway with pending entries. Returns: whether any went."""
        sent = False
        for address, entries in self._outbox.items():
            if entries:
                batch = internal_pb2.TokenBatch(requests=list(entries.values()))
                self._link(address).send(batch)
                sent = True
        self._outbox.clear()
        return sent

    def _link(self, address: str) -> GatewayLink:
        link = self._links.get(address)
        if link is None:
            link = GatewayLink(address, self._config.executor_id, self._events.put)
            self._links[address] = link
        return link

    # ---- status -------------------------------------------------------------------------

    def _refresh_status(self) -> None:
        if time.monotonic() >= self._next_status_s:
            self._post_status()

    def _post_status(self) -> None:
        self._next_status_s = time.monotonic() + STATUS_INTERVAL_S
        stats = self._engine.stats()
        self._metrics.record_stats(stats)
        engine_config = self._config.engine
        status = internal_pb2.ExecutorStatus(
            executor_id=self._config.executor_id,
            model_id=Path(engine_config.model).name,
            block_size=engine_config.block_size,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            max_num_seqs=engine_config.max_num_seqs,
            max_model_len=self._engine.max_model_len,
            session_ids=self._engine.session_ids(),
            cached_block_hashes=self._engine.cached_block_hashes(MAX_REPORTED_HASHES),
            prefix_hit_tokens=stats.prefix_hit_tokens,
            draining=not self._taking_work,
        )
        self._board.post(status)


def main(argv: list[str] | None = None) -> int:
    """Args: command-line flags (None: sys.argv). Returns: the exit status."""
    parse = functools.partial(ExecutorServiceConfig.from_args, argv)
    started = start_process("executor", parse, ExecutorMetrics)
    if started is None:
        return 2
    config, metrics = started
    add_log_context(executor_id=config.executor_id)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    # The step loop holds the GIL between torch ops; the threads that send tokens to gateways
    # and read the inbox would otherwise wait up to the default 5 ms for it after each step.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    client = connect_sync(config.redis_url, timeout_s=2.0)
    if another_executor_has_the_id(client, RedisKeys(config.redis_prefix), config.executor_id):
        print(
            f"executor: --executor-id {config.executor_id}: another live executor has this id "
            "(its heartbeat is being refreshed); give each executor its own id",
            file=sys.stderr,
        )
        return 2
    engine = Engine(config.engine)
    service = ExecutorService(config, engine, client, metrics)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: service.drain())
    service.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
