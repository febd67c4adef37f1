"""The window sweep's own local stack: one stack, the scheduler restarted per batch_window_ms.

`kvgate bench --sweep-window` must restart the scheduler, so it starts a stack of its own
(deploy/stack.py, as `make run` does: redis, scheduler, one executor, one gateway on a free
port) on --model, instead of using --target. Executor and gateway stay up between windows,
so each window's run also keeps the executor's prefix cache: the bench gives every sweep
point its own seed (seed + index), so no point's prompts were cached by an earlier one.
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


def window_flags(batch_window_ms: float) -> list[str]:
    return ["--batch-window-ms", f"{batch_window_ms:g}"]


@contextmanager
def local_stack(model: str, batch_window_ms: float, log_dir: Path = LOG_DIR) -> Iterator[Stack]:
    """Starts redis, a scheduler, one executor and a gateway; stops them all on exit.

    Args:
        model: the model folder.
        batch_window_ms: the first scheduler's window.
        log_dir: where the processes log.

    Yields:
        The serving stack (its gateway at stack.address).
    """
    config = StackConfig(
        model=model,
        port=free_port(),
        log_dir=log_dir,
        scheduler_flags=window_flags(batch_window_ms),
    )
    stack = Stack(config)
    print(f"kvgate bench: starting a local stack on {model} (logs in {log_dir})", file=sys.stderr)
    try:
        stack.start_all()
        yield stack
    finally:
        stack.stop_all()


def restart_scheduler(stack: Stack, batch_window_ms: float) -> None:
    """Stops the scheduler and starts one with `batch_window_ms` (once it holds the lock)."""
    stack.stop(SCHEDULER)
    stack.config.scheduler_flags = window_flags(batch_window_ms)
    stack.start_scheduler(SCHEDULER)


def warm_up(target: str) -> None:
    """Sends one short request and waits for it: the stack serves, its first forward pass
    is not measured."""
    with KvgateClient(target, timeout_s=120.0) as client:
        client.generate("warm up", max_tokens=2, temperature=0.0)
