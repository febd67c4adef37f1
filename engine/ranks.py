"""Tensor-parallel ranks of one executor (--tensor-parallel-size N).

Rank 0 is the executor process itself: it runs the engine (scheduling, sampling, Redis, the
gateways) and starts ranks 1..N-1 as child processes (`python -m engine.rank`). Every rank
loads its share of the model (engine/models/shard.py) and of the KV cache (its key/value
heads, the same block count on every rank); rank 0 broadcasts each step's inputs (token ids,
positions, slots, block tables, context lengths: int64 tensors, no pickle) and the followers
run the same forward pass on their share. The decoder's two all-reduces per layer sum the
ranks' partial outputs; only rank 0 computes logits. torch.distributed's gloo backend carries
the step inputs and, on the CPU, the all-reduces; NCCL does the all-reduces on CUDA.

A follower dies with rank 0 (PR_SET_PDEATHSIG), so a killed executor leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from kernels import AttentionStep, KernelBackend
from kernels.decoder import decoder_layers_with

logger = logging.getLogger("kvgate.executor")

_PR_SET_PDEATHSIG = 1
_ROOT = Path(__file__).resolve().parents[1]  # on the followers' PYTHONPATH
_STARTUP_TIMEOUT_S = 600.0  # a follower loads the whole checkpoint before it is ready
# Followers wait for rank 0's next step for as long as the executor idles.
_IDLE_TIMEOUT = timedelta(days=365)
_STOP, _STEP = 0, 1
# Header: kind, tokens, decode rows, decode table width, prefill rows, prefill table width.
_HEADER_LEN = 6


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or the CUDA device `rank` places after --device's."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} from "
                         f"--device {config.device} needs CUDA device {index}; this machine "
                         f"has {count}")  # fmt: skip
    return torch.device("cuda", index)


class RankStartError(RuntimeError):
    """A follower rank exited, or did not get ready, while the executor started."""


class RankGroup:
    """This process's place among the ranks, and the collectives the model runner uses."""

    def __init__(self, rank: int, size: int, device: torch.device, store: dist.TCPStore) -> None:
        self.rank, self.size, self.device, self.store = rank, size, device, store
        self.followers: list[subprocess.Popen] = []  # rank 0: the other ranks' processes
        self.failure: str | None = None  # rank 0: why the ranks are out of step, once they are
        # Rank 0: called once they are (the executor process exits, so its work moves on).
        self.on_failure: Callable[[str], None] | None = None
        self._threads_before = torch.get_num_threads()

    @classmethod
    def start(cls, config: EngineConfig) -> RankGroup:
        """Rank 0: start ranks 1..N-1 and return once every one has loaded its share.

        Raises:
            RankStartError: a rank exited or did not get ready (its error is on stderr).
        """
        size = config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=_STARTUP_TIMEOUT_S))  # fmt: skip
        group = cls(0, size, rank_device(config, 0), store)
        threads = group._share_threads(torch.get_num_threads())
        path = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
        spec = json.dumps(dataclasses.asdict(config))
        for rank in range(1, size):
            argv = [sys.executable, "-m", "engine.rank", "--rank", str(rank),
                    "--store-port", str(store.port), "--parent-pid", str(os.getpid()),
                    "--torch-threads", str(threads), "--engine-config", spec]  # fmt: skip
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)  # cwd: ours
            group.followers.append(proc)
        try:
            group._wait_followers_ready()
            group._init_process_group()
        except BaseException:
            group.abort()
            raise
        logger.info("tensor parallel: %d ranks, followers' pids %s", size,
                    [p.pid for p in group.followers])  # fmt: skip
        return group

    @classmethod
    def join(cls, config: EngineConfig, rank: int, store_port: int) -> RankGroup:
        """A follower: connect to rank 0's store (the process group comes once loaded)."""
        size, timeout = config.tensor_parallel_size, timedelta(seconds=_STARTUP_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False, timeout=timeout)
        return cls(rank, config.tensor_parallel_size, rank_device(config, rank), store)

    def ready(self) -> RankGroup:
        """A follower: say it has loaded its share, then join the process group."""
        self.store.set(f"ready/{self.rank}", "1")
        self._init_process_group()
        return self

    def _share_threads(self, threads: int) -> int:
        """On the CPU the executor's threads are shared out among its ranks."""
        if self.device.type != "cpu":
            return threads
        per_rank = max(1, threads // self.size)
        torch.set_num_threads(per_rank)
        return per_rank

    def _wait_followers_ready(self) -> None:
        keys = [f"ready/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self.store.check(keys):
            for rank, proc in enumerate(self.followers, start=1):
                if proc.poll() is not None:
                    raise RankStartError(f"tensor-parallel rank {rank} exited with status "
                                       f"{proc.returncode} while loading the model")  # fmt: skip
            if time.monotonic() > deadline:
                raise RankStartError(
                    f"tensor-parallel ranks not ready after {_STARTUP_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group: one "
                               "tensor-parallel engine per process")  # fmt: skip
        backend = "gloo" if self.device.type == "cpu" else "cpu:gloo,cuda:nccl"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, store=self.store, rank=self.rank,
                                world_size=self.size, timeout=_IDLE_TIMEOUT)  # fmt: skip

    # ---- collectives ----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (a row- or column-major 2-D tensor); returns x."""
        buffer = x if x.is_contiguous() else x.t()
        if not buffer.is_contiguous():
            raise ValueError(f"all_reduce needs a row- or column-major tensor, got {x.stride()}")
        dist.all_reduce(buffer)
        return x

    def min(self, value: int) -> int:
        """The smallest of the ranks' `value`s (e.g. how many KV blocks each has room for)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def send_step(self, input_ids: torch.Tensor, step: AttentionStep) -> None:
        """Rank 0: give the followers this step's inputs.

        Raises:
            RuntimeError: an earlier step left the ranks out of step (`fail`).
        """
        if self.failure is not None:
            raise RuntimeError(f"the tensor-parallel ranks stopped: {self.failure}")
        decode, prefill = step.decode_block_tables, step.prefill_block_tables
        header = [_STEP, input_ids.shape[0], *decode.shape, *prefill.shape]
        parts = [input_ids, step.positions, step.slot_mapping, decode, step.decode_context_lens,
                 prefill, step.prefill_cu_seqlens_q, step.prefill_context_lens]  # fmt: skip
        payload = torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts])
        dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0)
        dist.broadcast(payload, src=0)

    def receive_step(self, step: AttentionStep) -> tuple[torch.Tensor, AttentionStep] | None:
        """A follower: the next step's token ids and `step` (its model's constants) with that
        step's inputs; None when rank 0 stops."""
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0)
        kind, tokens, decode_rows, decode_width, prefill_rows, prefill_width = header.tolist()
        if kind == _STOP:
            return None
        sizes = [tokens, tokens, tokens, decode_rows * decode_width, decode_rows,
                 prefill_rows * prefill_width, prefill_rows + 1, prefill_rows]  # fmt: skip
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        dist.broadcast(payload, src=0)
        ids, positions, slots, d_tables, d_lens, p_tables, cu, p_lens = [
            p.to(self.device) for p in payload.split(sizes)
        ]
        i32 = torch.int32
        return ids, dataclasses.replace(
            step, positions=positions, slot_mapping=slots, num_decode_tokens=decode_rows,
            decode_block_tables=d_tables.to(i32).view(decode_rows, decode_width),
            decode_context_lens=d_lens.to(i32),
            prefill_block_tables=p_tables.to(i32).view(prefill_rows, prefill_width),
            prefill_cu_seqlens_q=cu.to(i32), prefill_context_lens=p_lens.to(i32), prepared=None,
        )  # fmt: skip

    def fail(self, error: BaseException) -> None:
        """Rank 0: a step failed once its inputs went out (a rank died, or a kernel raised
        midway), so the ranks' collectives no longer pair up: stop the followers; every later
        step raises, and `on_failure` is called."""
        if self.failure is not None:
            return
        self.failure = f"a step failed on the ranks ({type(error).__name__}: {error})"
        logger.error("tensor parallel: %s; the other ranks are stopped", self.failure)
        for proc in self.followers:
            proc.kill()
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def close(self) -> None:
        """Rank 0: stop the followers between steps (they exit), leave the process group."""
        if self.failure is None and dist.is_initialized():
            try:
                dist.broadcast(torch.tensor([_STOP] + [0] * (_HEADER_LEN - 1)), src=0)
            except RuntimeError as error:  # a rank already gone: the others are killed below
                logger.warning("tensor parallel: stopping the ranks: %s", error)
                return self.leave(wait_s=0.0)
        self.leave(wait_s=10.0)

    def abort(self) -> None:
        """Rank 0: kill the followers wherever they are (start-up failed), leave the group."""
        self.leave(wait_s=0.0)

    def leave(self, wait_s: float = 0.0) -> None:
        """Leave the process group (rank 0: once its followers exited, killed after wait_s)."""
        for proc in self.followers:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.followers = []
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)


def with_all_reduce(kernels: KernelBackend, group: RankGroup) -> KernelBackend:
    """`kernels` with a decoder stack that sums the ranks' partial projections (on the CPU the
    layers run one kernel call at a time then: the same C kernels as the one-call stack)."""
    stack = decoder_layers_with(
        kernels.linear,
        kernels.linear_quantized,
        kernels.rms_norm,
        kernels.attention,
        kernels.silu_and_mul,
        group.all_reduce,
    )
    return dataclasses.replace(kernels, decoder_layers=stack)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (and exit now if it has)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
