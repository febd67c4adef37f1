"""The host tier of the KV cache: blocks in host memory that device blocks are copied to
(swap out) and back from (swap in).

`HostTier` is the block manager's side: which host blocks are free, and the copies the
manager decided on, in the order it decided them. `HostKVPool` is the model runner's side:
the host tensors and the copies themselves. On CPU the pool is a second set of tensors and a
copy is a plain tensor copy. On CUDA the host tensors are pinned and the copies run on a
side stream, asynchronously: the step that follows computes while they run, and waits (on
the GPU, not in Python) only for the copies that touch a block the step reads or writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_memory import zeroed_tensor


@dataclass(slots=True, frozen=True)
class SwapOp:
    """Copy one block between the tiers: device to host when `to_host`, else host to device."""

    to_host: bool
    device_block: int
    host_block: int


@dataclass(slots=True, frozen=True)
class BlockCopy:
    """Copy one device block into another (a shared block copied on write)."""

    source: int
    destination: int


KVOp = SwapOp | BlockCopy


class HostTier:
    """Host blocks free or owned (each by one swapped-out request or offloaded session), and
    the queue of copies the engine runs before the next forward pass (with the device's own
    block copies, in the one order the block manager decided them)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # lowest id popped first
        self._ops: list[KVOp] = []
        self.num_swapped_out_blocks = 0  # cumulative
        self.num_swapped_in_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def swap_out(self, device_blocks: list[int]) -> list[int]:
        """Take a host block for each device block and queue the copies to them.

        Returns:
            The host blocks, in the order of `device_blocks`.
        """
        if len(device_blocks) > len(self._free):
            raise RuntimeError(f"{len(device_blocks)} blocks to swap out, {len(self._free)} free")
        host_blocks = [self._free.pop() for _ in device_blocks]
        self._ops += [SwapOp(True, d, h) for d, h in zip(device_blocks, host_blocks, strict=True)]
        self.num_swapped_out_blocks += len(device_blocks)
        return host_blocks

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Queue the copies of `host_blocks` into `device_blocks` (the caller frees the host
        blocks, or keeps them, as it owns them)."""
        self._ops += [SwapOp(False, d, h) for h, d in zip(host_blocks, device_blocks, strict=True)]
        self.num_swapped_in_blocks += len(device_blocks)

    def copy_block(self, source: int, destination: int) -> None:
        """Queue a copy of device block `source` into device block `destination`."""
        self._ops.append(BlockCopy(source, destination))

    def free(self, host_blocks: list[int]) -> None:
        """Give host blocks back. Copies queued from them still read what they hold: a later
        swap out into them is queued, and run, after those copies."""
        self._free.extend(reversed(host_blocks))

    def cancel_swap_in(self, device_blocks: list[int]) -> None:
        """Drop queued copies into `device_blocks` (their request let them go before the step
        ran: the blocks may be handed to another request in the same step)."""
        if not self._ops:
            return
        dropped = set(device_blocks)
        kept = [
            op
            for op in self._ops
            if not isinstance(op, SwapOp) or op.to_host or op.device_block not in dropped
        ]
        self.num_swapped_in_blocks -= len(self._ops) - len(kept)
        self._ops = kept

    def take_ops(self) -> list[KVOp]:
        """The queued copies, in order, leaving the queue empty."""
        ops, self._ops = self._ops, []
        return ops


class HostKVPool:
    """Host copies of every KV cache tensor of the device pool, `num_blocks` blocks each."""

    def __init__(self, device_caches: list[tuple[torch.Tensor, ...]], num_blocks: int) -> None:
        """Args: device_caches: per layer, the tensors whose first dimension is the block."""
        self.device_caches = device_caches
        device = device_caches[0][0].device
        pin = device.type == "cuda"
        self.host_caches = [
            tuple(_host_tensor((num_blocks, *t.shape[1:]), t.dtype, pin) for t in layer)
            for layer in device_caches
        ]
        self._stream = torch.cuda.Stream(device) if pin else None
        # CUDA: copies still in flight, with the device blocks each touches
        self._in_flight: list[tuple[torch.cuda.Event, set[int]]] = []

    def copy(self, ops: list[KVOp]) -> None:
        """Run the copies in order (CUDA: queue them on the side stream, after the work
        already queued on the compute stream, which wrote the blocks read here)."""
        if not ops:
            return
        if self._stream is None:
            self._copy_runs(ops)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            self._copy_runs(ops)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._in_flight.append((event, set(_device_blocks(ops))))

    @property
    def has_copies_in_flight(self) -> bool:
        return bool(self._in_flight)

    def wait_all(self) -> None:
        """Wait (on the host) until every copy in flight is done: the host blocks are then
        what the block manager believes (reading them, to move an offloaded session)."""
        for event, _ in self._in_flight:
            event.synchronize()
        self._in_flight = []

    def wait_for(self, device_blocks: set[int]) -> None:
        """Make the compute stream wait for the copies in flight that touch `device_blocks`
        (the blocks of the step about to run); other copies keep overlapping with it."""
        still = []
        for event, touched in self._in_flight:
            if event.query():
                continue
            if touched & device_blocks:
                torch.cuda.current_stream(self._stream.device).wait_event(event)
            else:
                still.append((event, touched))
        self._in_flight = still

    def _copy_runs(self, ops: list[KVOp]) -> None:
        """Copy each run of swaps that moves consecutive blocks the same way in one slice copy;
        a device block copy between them where it was queued."""
        start = 0
        for i, op in enumerate([*ops, None]):
            if isinstance(op, SwapOp):
                continue
            self._swap_runs(ops[start:i])
            if op is not None:
                copy_device_blocks(self.device_caches, [op])
            start = i + 1

    def _swap_runs(self, ops: list[SwapOp]) -> None:
        for to_host, device_start, host_start, n in _runs(ops):
            dev, host = slice(device_start, device_start + n), slice(host_start, host_start + n)
            for device_layer, host_layer in zip(self.device_caches, self.host_caches, strict=True):
                for d, h in zip(device_layer, host_layer, strict=True):
                    if to_host:
                        h[host].copy_(d[dev], non_blocking=True)
                    else:
                        d[dev].copy_(h[host], non_blocking=True)


def copy_device_blocks(device_caches: list[tuple[torch.Tensor, ...]], copies: list[BlockCopy]):
    """Copy each `source` block into its `destination`, in every cache tensor."""
    if not copies:
        return
    device = device_caches[0][0].device
    sources = torch.tensor([c.source for c in copies], device=device)
    destinations = torch.tensor([c.destination for c in copies], device=device)
    for layer in device_caches:
        for tensor in layer:
            tensor[destinations] = tensor[sources]


def _device_blocks(ops: list[KVOp]) -> list[int]:
    """The device blocks the ops read or write."""
    blocks = []
    for op in ops:
        if isinstance(op, SwapOp):
            blocks.append(op.device_block)
        else:
            blocks += [op.source, op.destination]
    return blocks


def _runs(ops: list[SwapOp]) -> list[tuple[bool, int, int, int]]:
    """(to_host, first device block, first host block, length) of each run of `ops` whose
    device and host blocks both count up by one, in order."""
    runs: list[tuple[bool, int, int, int]] = []
    for op in ops:
        if runs:
            to_host, d0, h0, n = runs[-1]
            if to_host == op.to_host and op.device_block == d0 + n and op.host_block == h0 + n:
                runs[-1] = (to_host, d0, h0, n + 1)
                continue
        runs.append((op.to_host, op.device_block, op.host_block, 1))
    return runs


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Zeros for the host tier: pinned for CUDA copies, else resident only where written."""
    if pin:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return zeroed_tensor(shape, dtype)
