"""`python -m executor`: run one executor (flags: `python -m executor --help`)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading

import grpc
import redis
import torch

from common.health import start_health
from common.keys import RedisKeys
from common.logs import add_log_context
from common.metrics import METRICS_DISABLED
from common.redis_conn import connect_sync
from common.startup import start_process, stop_on_signals
from common.tls import TLSFileError
from engine.engine import Engine
from engine.faults import Faults, install_faults
from engine.kv_move import movable_engine
from engine.ranks import RankStartError
from executor.config import ExecutorConfig
from executor.drain import DrainMoves
from executor.gateway_link import SinkCredentials
from executor.heartbeat import another_executor_has_the_id
from executor.kv_sender import KvSender
from executor.kv_transfer import KvReceiver, KvTransferConfig, start_kv_server
from executor.metrics import ExecutorMetrics
from executor.rebalance import SessionRebalancer
from executor.service import ExecutorService

log = logging.getLogger(__name__)
# Exit status when the tensor-parallel ranks fall out of step (a rank died): as a crash.
RANKS_LOST_STATUS = 70
# Longest time a thread holding the GIL keeps it while another thread asks for it, in seconds.
GIL_SWITCH_INTERVAL_S = 0.0002


def main(argv: list[str] | None = None) -> int:
    """Args: command-line flags (None: sys.argv). Returns: the exit status."""
    parse = functools.partial(ExecutorConfig.from_args, argv)
    started = start_process("executor", parse, ExecutorMetrics)
    if started is None:
        return 2
    config, metrics = started
    add_log_context(executor_id=config.executor_id)
    sink_credentials = _sink_credentials(config)
    if sink_credentials is None:
        return 2
    _set_threads(config)
    client = connect_sync(config.redis_url, timeout_s=2.0)
    if _id_taken(config, client):
        return 2
    # NOT_SERVING while the model loads (a liveness probe answers meanwhile).
    health = start_health("executor", config, metrics.registry, {"model": "loading the model"})
    if health is None:
        return 2
    loaded = _load_engine(config, metrics)
    if loaded is None:
        health.stop()
        return 2
    engine, faults = loaded
    service = ExecutorService(config, engine, client, metrics, sink_credentials)
    try:
        kv_server = _start_kv_transfer(
            config, engine, client, metrics, service, faults, sink_credentials.secret
        )
    except (OSError, TLSFileError) as error:
        print(f"executor: {error}", file=sys.stderr)
        health.stop()
        return 2
    health.remove_check("model")
    health.add_check("draining", service.draining_check)
    health.add_check("step_loop", service.step_loop_check)
    _drain_on_signals(service, health)
    drained = False
    try:
        service.run()
        drained = True
    finally:
        if kv_server is not None:
            kv_server.stop(None)
        if drained:
            _wait_for_a_scrape(config, metrics)
        health.stop()
        engine.close()
    return 0


def _wait_for_a_scrape(config: ExecutorConfig, metrics: ExecutorMetrics) -> None:
    """After a drain: let a scrape read the drain's counts (--drain-scrape-wait-s), which an
    exit right after them would leave unseen (the moves-falling-back alert would miss it)."""
    if config.drain_scrape_wait_s <= 0 or config.metrics_port == METRICS_DISABLED:
        return
    log.info("drained: waiting up to %g s for a metrics scrape", config.drain_scrape_wait_s)
    if metrics.scrapes.wait(metrics.scrapes.next_scrape(), config.drain_scrape_wait_s):
        log.info("a metrics scrape read the drain's counts")
    else:
        log.warning(
            "no metrics scrape within --drain-scrape-wait-s %g s: the drain's last counts "
            "are not seen", config.drain_scrape_wait_s,
        )  # fmt: skip


def _sink_credentials(config: ExecutorConfig) -> SinkCredentials | None:
    """How to reach gateways' TokenSinks (None: a file cannot be read; printed)."""
    try:
        return SinkCredentials.from_files(
            config.sink_tls_ca,
            config.sink_tls_cert,
            config.sink_tls_key,
            config.sink_tls_server_name,
            config.sink_secret_file,
        )
    except TLSFileError as error:
        print(f"executor: {error}", file=sys.stderr)
        return None


def _set_threads(config: ExecutorConfig) -> None:
    """torch's thread count (--torch-threads) and how soon a thread gets the GIL."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    # The step loop holds the GIL between torch ops; the threads that send tokens to gateways
    # and read the inbox would otherwise wait up to the default 5 ms for it after each step.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def _id_taken(config: ExecutorConfig, client: redis.Redis) -> bool:
    """Whether a live executor already has --executor-id (printed when it has)."""
    if not another_executor_has_the_id(client, RedisKeys(config.redis_prefix), config.executor_id):
        return False
    print(
        f"executor: --executor-id {config.executor_id}: another live executor has this id "
        "(its heartbeat is being refreshed); give each executor its own id",
        file=sys.stderr,
    )
    return True


def _load_engine(
    config: ExecutorConfig, metrics: ExecutorMetrics
) -> tuple[Engine, Faults | None] | None:
    """The engine with its fault hooks (None: it cannot load; the reason is printed)."""
    try:
        engine = Engine(config.engine)
    except (ValueError, FileNotFoundError, RankStartError) as error:  # named for the user
        print(f"executor: {error}", file=sys.stderr)
        return None
    if engine.runner.group is not None:
        engine.runner.group.on_failure = _exit_ranks_lost
    faults = install_faults(engine)
    kernels = engine.runner.kernels
    metrics.record_kernels(kernels.name, kernels.cpu_isa)
    return engine, faults


def _start_kv_transfer(
    config, engine, client, metrics, service, faults, secret
) -> grpc.Server | None:
    """Serve KvTransfer and move KV to peers on a drain (none with --kv-transfer-port -1).

    Args:
        secret: --sink-secret-file's secret (None: none), as the TokenSink link read it.

    Raises:
        OSError: the port cannot be bound. TLSFileError: a file cannot be read.
    """
    if config.kv_transfer_port == -1:
        return None
    why = movable_engine(engine)
    if why is not None:  # peers must not pick it, and a drain here finishes its streams
        log.info("no KvTransfer service: %s", why)
        return None
    transfer = KvTransferConfig.of(config, secret)
    names = frozenset(n.strip() for n in config.kv_tls_allowed_names.split(",") if n.strip())
    receiver = KvReceiver(engine, service.gate, metrics, service.taking_work, secret, names)
    server, address = start_kv_server(transfer, receiver)
    sender = KvSender(engine, transfer, metrics, config.executor_id, faults or Faults())
    keys = RedisKeys(config.redis_prefix)
    moves = DrainMoves(engine, client, keys, config.executor_id, sender, metrics)
    rebalancer = None
    if config.rebalance_sessions:
        rebalancer = SessionRebalancer(
            engine, client, keys, config.executor_id, sender, metrics, service.post_event
        )
    service.attach_moves(moves, address, rebalancer)
    return server


def _exit_ranks_lost(reason: str) -> None:
    """The executor cannot run steps any more: exit, so its requests resume elsewhere."""
    print(f"executor: tensor parallel: {reason}; exiting", file=sys.stderr, flush=True)
    os._exit(RANKS_LOST_STATUS)


def _drain_on_signals(service: ExecutorService, health) -> None:
    """SIGTERM/SIGINT drain the executor: its event is set from a short thread
    (stop_on_signals), and a thread waiting on it drains and rechecks health."""
    drain = threading.Event()
    stop_on_signals(drain)
    threading.Thread(
        target=lambda: (drain.wait(), service.drain(), health.recheck()),
        name="drain-signal",
        daemon=True,
    ).start()


if __name__ == "__main__":
    sys.exit(main())
