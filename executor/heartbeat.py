"""The executor's heartbeat: its status (what the scheduler places by), published in Redis with
a short TTL (it is alive while the key exists), and the check that no live executor has its
id."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import redis

from common.keys import EXECUTOR_STATUS_TTL_MS, HEARTBEAT_INTERVAL_S, RedisKeys
from common.model_files import model_id
from common.redis_conn import Backoff, OutageLog, describe
from engine.engine import Engine
from engine.outputs import EngineStats
from executor.config import ExecutorConfig
from kernels.kv_format import format_name
from protos.kvgate.v1 import internal_pb2

log = logging.getLogger(__name__)
# Most prefix-cache block hashes reported in a heartbeat.
MAX_REPORTED_HASHES = 1024


def executor_status(
    config: ExecutorConfig,
    engine: Engine,
    stats: EngineStats,
    draining: bool,
    kv_transfer_address: str,
) -> internal_pb2.ExecutorStatus:
    """What the heartbeat says of this executor now: its model, cache and load (`stats`, the
    engine's of this moment), its sessions and cached prefixes, and whether it drains."""
    engine_config = config.engine
    return internal_pb2.ExecutorStatus(
        executor_id=config.executor_id,
        model_id=model_id(engine_config.model),
        block_size=engine_config.block_size,
        num_free_blocks=engine.num_available_blocks(),
        num_total_blocks=stats.num_total_blocks,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        max_num_seqs=engine_config.max_num_seqs,
        max_model_len=engine.max_model_len,
        session_ids=engine.session_ids(),
        cached_block_hashes=engine.cached_block_hashes(MAX_REPORTED_HASHES),
        prefix_hit_tokens=stats.prefix_hit_tokens,
        num_host_blocks_total=stats.num_host_blocks_total,
        num_host_blocks_used=stats.num_host_blocks_used,
        draining=draining,
        kv_transfer_address=kv_transfer_address,
        kv_cache_dtype=format_name(engine.runner.kv_cache_dtype),
    )


@dataclass(slots=True)
class StatusBoard:
    """The latest ExecutorStatus, written by the step loop, published by the heartbeat, and
    when the step loop last went round (the heartbeat stops while it is stuck)."""

    status: internal_pb2.ExecutorStatus = field(default_factory=internal_pb2.ExecutorStatus)
    lock: threading.Lock = field(default_factory=threading.Lock)
    progressed_s: float = field(default_factory=time.monotonic)

    def post(self, status: internal_pb2.ExecutorStatus) -> None:
        with self.lock:
            self.status = status

    def read(self) -> internal_pb2.ExecutorStatus:
        with self.lock:
            return self.status

    def progress(self) -> None:
        """The step loop went round once (a float store: no lock needed)."""
        self.progressed_s = time.monotonic()

    def stalled_s(self) -> float:
        """Seconds since the step loop last went round."""
        return time.monotonic() - self.progressed_s


class Heartbeat:
    """Publishes the executor's status every HEARTBEAT_INTERVAL_S, with a TTL.

    Redis down is logged once; beats are then retried with backoff until it answers. While
    the step loop has not gone round for `step_stall_s` (a wedged step), the heartbeat
    withdraws the status instead: to the scheduler and the gateways the executor is gone, so
    nothing more is placed on it and its requests resume elsewhere; once the loop goes round
    again it beats again and rejoins.
    """

    def __init__(
        self, client: redis.Redis, keys: RedisKeys, board: StatusBoard, step_stall_s: float = 5.0
    ) -> None:
        self._client = client
        self._keys = keys
        self._board = board
        self._step_stall_s = step_stall_s
        self._withdrawn = False
        self._outage = OutageLog(log, "heartbeat")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        """Beats once (when Redis answers), then every HEARTBEAT_INTERVAL_S on a thread."""
        self.try_beat()
        self._thread.start()

    def stop(self) -> None:
        """Stops beating and removes the status: the executor is gone."""
        self._stop.set()
        self._thread.join()
        status = self._board.read()
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._keys.executor_status(status.executor_id))
            pipe.srem(self._keys.executors, status.executor_id)
            pipe.execute()
        except redis.RedisError as error:
            log.warning("could not remove the executor status: %s", describe(error))

    def stuck_check(self) -> str | None:
        """The health condition of the step loop: None while it goes round."""
        stalled_s = self._board.stalled_s()
        if stalled_s >= self._step_stall_s:
            return f"the step loop has been stuck for {stalled_s:.0f} s"
        return None

    def _beat_or_withdraw(self) -> bool:
        """A beat, or the status withdrawn while the step loop is stuck.

        Returns: False when Redis failed.
        """
        stuck = self.stuck_check()
        if stuck is None:
            if self._withdrawn:
                log.warning("heartbeat: the step loop goes round again; beating again")
                self._withdrawn = False
            return self.try_beat()
        if self._withdrawn:
            return True
        executor_id = self._board.read().executor_id
        try:
            self._client.delete(self._keys.executor_status(executor_id))
        except redis.RedisError as error:
            self._outage.failed(error)
            return False
        log.error("heartbeat: %s; status withdrawn (its requests resume elsewhere)", stuck)
        self._withdrawn = True
        return True

    def beat(self) -> None:
        """Writes the current status once."""
        status = internal_pb2.ExecutorStatus()
        status.CopyFrom(self._board.read())
        status.heartbeat_unix_ms = int(time.time() * 1000)
        pipe = self._client.pipeline(transaction=True)
        pipe.set(
            self._keys.executor_status(status.executor_id),
            status.SerializeToString(),
            px=EXECUTOR_STATUS_TTL_MS,
        )
        pipe.sadd(self._keys.executors, status.executor_id)
        pipe.execute()

    def try_beat(self) -> bool:
        """Writes the current status once. Returns: False when Redis failed (down, or an
        error reply such as READONLY during a failover); logged once per outage."""
        try:
            self.beat()
        except redis.RedisError as error:
            self._outage.failed(error)
            return False
        self._outage.succeeded()
        return True

    def _run(self) -> None:
        delays = Backoff(max_s=HEARTBEAT_INTERVAL_S).delays()
        wait_s = HEARTBEAT_INTERVAL_S if not self._outage.down else next(delays)
        while not self._stop.wait(wait_s):
            if self._beat_or_withdraw():
                delays = Backoff(max_s=HEARTBEAT_INTERVAL_S).delays()
                wait_s = HEARTBEAT_INTERVAL_S
            else:
                wait_s = next(delays)


def another_executor_has_the_id(client: redis.Redis, keys: RedisKeys, executor_id: str) -> bool:
    """Whether a live executor already uses `executor_id`: its status key is still there one
    heartbeat TTL later (a crashed one's key expires by then). False when Redis is down."""
    key = keys.executor_status(executor_id)
    try:
        if not client.exists(key):
            return False
        time.sleep(EXECUTOR_STATUS_TTL_MS / 1000 + HEARTBEAT_INTERVAL_S)
        return bool(client.exists(key))
    except redis.RedisError:
        return False
