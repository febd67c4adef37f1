"""The sweeps' own local stack: the scheduler restarted per batch_window_ms, or the scheduler
and the executor restarted per ordering policy.

`kvgate bench --sweep-window` and `--sweep-policy` must restart processes, so they start a
stack of their own (deploy/stack.py, as `make run` does: redis, scheduler, one executor, one
gateway on a free port) on --model, instead of using --target. In the window sweep executor
and gateway stay up between windows, so each window's run also keeps the executor's prefix
cache: the bench gives every sweep point its own seed (seed + index), so no point's prompts
were cached by an earlier one. The policy sweep restarts the executor with each policy, so
every policy runs the same requests on an empty cache.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from client.api import KvgateClient
from deploy.stack import ROOT, Stack, StackConfig, free_port

LOG_DIR = ROOT / ".run" / "bench-logs"
SCHEDULER = "scheduler"
EXECUTOR = "executor-0"


def window_flags(batch_window_ms: float) -> list[str]:
    return ["--batch-window-ms", f"{batch_window_ms:g}"]


@contextmanager
def local_stack(
    model: str,
    log_dir: Path = LOG_DIR,
    scheduler_flags: list[str] | None = None,
    executor_flags: list[str] | None = None,
) -> Iterator[Stack]:
    """Starts redis, a scheduler, one executor and a gateway; stops them all on exit.

    Args:
        model: the model folder.
        log_dir: where the processes log.
        scheduler_flags, executor_flags: the first scheduler's and executor's own flags.

    Yields:
        The serving stack (its gateway at stack.address).
    """
    config = StackConfig(
        model=model,
        port=free_port(),
        log_dir=log_dir,
        scheduler_flags=list(scheduler_flags or []),
        executor_flags=list(executor_flags or []),
    )
    stack = Stack(config)
    print(f"kvgate bench: starting a local stack on {model} (logs in {log_dir})", file=sys.stderr)
    try:
        stack.start_all()
        yield stack
    finally:
        stack.stop_all()


def restart_scheduler(stack: Stack, flags: list[str]) -> None:
    """Stops the scheduler and starts one with `flags` (returns once it holds the lock)."""
    stack.stop(SCHEDULER)
    stack.config.scheduler_flags = list(flags)
    stack.start_scheduler(SCHEDULER)


def restart_executor(stack: Stack, flags: list[str]) -> None:
    """Stops the executor (its cache goes with it) and starts one with `flags`; returns once
    it has sent a heartbeat."""
    stack.stop(EXECUTOR)
    stack.redis().delete(stack.keys.executor_status(EXECUTOR))
    stack.config.executor_flags = list(flags)
    stack.start_executor(EXECUTOR)


def warm_up(target: str) -> None:
    """Sends one short request and waits for it: the stack serves, its first forward pass
    is not measured."""
    with KvgateClient(target, timeout_s=120.0) as client:
        client.generate("warm up", max_tokens=2, temperature=0.0)
