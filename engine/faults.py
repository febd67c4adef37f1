"""Faults a test switches on in a real executor process, through the KVGATE_FAULTS
environment variable (unset in production: nothing is installed).

    KVGATE_FAULTS="raise_on_token=511,exit_on_token=510,stall_when_file=/tmp/x:60"
    KVGATE_FAULTS="slow_while_file=/tmp/y:0.05"

- raise_on_token=N: the model's forward pass raises while its batch holds a request whose
  prompt holds token id N (a poison request);
- exit_on_token=N: the process dies at once (exit status 70, like a crash in a kernel) when
  such a request is in the batch;
- stall_when_file=PATH:SECONDS: while the file PATH exists, the next forward pass sleeps
  SECONDS (a wedged step loop), once per creation of the file (it is deleted then);
- slow_while_file=PATH:SECONDS: while the file PATH exists, every forward pass sleeps
  SECONDS first (a slow model: running requests take as long as the test wants);
- corrupt_kv_chunks=1: a draining executor's KV pushes (executor/kv_sender.py) flip a byte
  of each chunk after its CRC-32 is taken (a chunk corrupted on the way);
- hold_kv_pushes_while_file=PATH: a KV push holds its stream open after its last chunk while
  the file PATH exists (a transfer in the middle, for as long as the test wants).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.engine import Engine
from engine.step_scheduler import SchedulerOutput

log = logging.getLogger(__name__)
FAULTS_ENV = "KVGATE_FAULTS"
CRASH_STATUS = 70


class InjectedFault(RuntimeError):
    """The error the raise_on_token fault raises."""


@dataclass(slots=True)
class Faults:
    raise_on_token: int | None = None
    exit_on_token: int | None = None
    stall_file: Path | None = None
    stall_s: float = 0.0
    slow_file: Path | None = None
    slow_s: float = 0.0
    corrupt_kv_chunks: bool = False
    hold_kv_file: Path | None = None

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """Raises: ValueError naming the part of `spec` it cannot read."""
        faults = cls()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = part.partition("=")
            if name in ("raise_on_token", "exit_on_token") and value.isdigit():
                setattr(faults, name, int(value))
            elif name == "corrupt_kv_chunks" and value in ("0", "1"):
                faults.corrupt_kv_chunks = value == "1"
            elif name == "hold_kv_pushes_while_file" and value:
                faults.hold_kv_file = Path(value)
            elif name in ("stall_when_file", "slow_while_file") and ":" in value:
                path, _, seconds = value.rpartition(":")
                kind = name.split("_")[0]
                setattr(faults, f"{kind}_file", Path(path))
                setattr(faults, f"{kind}_s", float(seconds))
            else:
                raise ValueError(f"{FAULTS_ENV}: cannot read {part!r}")
        return faults

    def kv_chunk(self, data: bytes) -> bytes:
        """A KV push's chunk as it goes out (corrupted after its CRC-32 was taken, with
        corrupt_kv_chunks)."""
        if not self.corrupt_kv_chunks or not data:
            return data
        log.warning("fault: a KV chunk goes out corrupted")
        return bytes([data[0] ^ 0xFF]) + data[1:]

    def hold_kv_push(self) -> None:
        """Hold a KV push open after its last chunk while the hold file exists."""
        while self.hold_kv_file is not None and self.hold_kv_file.exists():
            time.sleep(0.01)

    def before_forward(self, out: SchedulerOutput) -> None:
        if self.stall_file is not None and self.stall_file.exists():
            self.stall_file.unlink()
            log.warning("fault: the step stalls for %g s", self.stall_s)
            time.sleep(self.stall_s)
        if self.slow_file is not None and self.slow_file.exists():
            time.sleep(self.slow_s)
        prompts = [s.request.prompt_token_ids for s in out.scheduled]
        if self.exit_on_token is not None and any(self.exit_on_token in p for p in prompts):
            log.error("fault: a request's prompt holds token %d: exiting", self.exit_on_token)
            os._exit(CRASH_STATUS)
        if self.raise_on_token is not None and any(self.raise_on_token in p for p in prompts):
            raise InjectedFault(f"fault: a request's prompt holds token {self.raise_on_token}")


def install_faults(engine: Engine) -> Faults | None:
    """Wraps the engine's forward pass with the faults KVGATE_FAULTS names, if any.

    Returns: the faults (the KV pushes read theirs there), None when none are set."""
    spec = os.environ.get(FAULTS_ENV, "")
    if not spec:
        return None
    faults = Faults.parse(spec)
    execute: Callable = engine.runner.execute

    def execute_with_faults(out: SchedulerOutput):
        faults.before_forward(out)
        return execute(out)

    engine.runner.execute = execute_with_faults
    log.warning("%s=%s: faults installed in the forward pass (tests only)", FAULTS_ENV, spec)
    return faults
