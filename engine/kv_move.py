"""KV that moves between engines: a sequence's blocks as bytes, and the layout they are in.

A draining executor sends each idle session's and each running request's KV to a peer
(executor/kv_transfer.py); this module is the engine's side of it, with no gRPC: what a
block's bytes are, which layouts can take which, and taking blocks in.

A block travels as its bytes in the cache's own format: for each layer, its K then its V
(`block_size` tokens of `token_bytes` each; an int8 or fp8 token's bfloat16 scale is part of
its bytes, kernels/kv_format.py). Nothing is converted: a receiver whose cache has another
element format, model, block size or layer shape refuses the transfer naming the difference,
and the sequence is recomputed there instead (recomputing is always correct; a conversion
would be a second quantization the sequence never had).
"""

from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from common.model_files import model_id
from kernels.kv_format import format_name

if TYPE_CHECKING:
    from engine.engine import Engine

# The tensors of one layer's cache: (K, V), each [num_blocks, block_size, *token].
LayerCaches = list[tuple[torch.Tensor, torch.Tensor]]


class KVRefused(Exception):
    """A transfer this engine cannot take: the message says why (a layout difference, or no
    room for the blocks: `no_room`)."""

    def __init__(self, message: str, no_room: bool = False) -> None:
        super().__init__(message)
        self.no_room = no_room


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a block's bytes mean: two engines move KV only when their layouts are equal."""

    model_id: str
    block_size: int
    kv_cache_dtype: str  # kernels.kv_format.KV_CACHE_DTYPES name
    num_layers: int
    token_bytes: int  # one token's K (or V) in one layer, its scale included
    # two checkpoints under one name (a folder updated in place during a rolling upgrade)
    # write different KV for the same tokens
    weights_fingerprint: str = ""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, K and V."""
        return 2 * self.num_layers * self.block_size * self.token_bytes

    def difference(self, sender: KVLayout) -> str | None:
        """Why this engine cannot take blocks written in `sender`'s layout, or None."""
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(sender, field.name)
            if mine != theirs:
                return f"{field.name} differs: the sender has {theirs!r}, this executor {mine!r}"
        return None


@dataclass(slots=True)
class MovableKV:
    """One sequence's KV as a move sees it: the tokens its blocks hold, and the blocks (held
    for the move: `Engine.release_moved` gives them back)."""

    token_ids: list[int]
    block_ids: list[int]
    cache_salt: str | None
    session_id: str | None  # an idle session's, or the session of a request's turn
    request_id: str = ""  # empty for an idle session
    index: int = 0  # the choice a request's sequence is
    on_host: bool = False  # the blocks are host-tier blocks (an offloaded session)


def layout_of(
    model_id: str,
    block_size: int,
    kv_cache_dtype: str,
    caches: LayerCaches,
    weights_fingerprint: str = "",
) -> KVLayout:
    """The layout of an engine's device caches."""
    key = caches[0][0]
    token_bytes = math.prod(key.shape[2:]) * key.element_size()
    return KVLayout(
        model_id, block_size, kv_cache_dtype, len(caches), token_bytes, weights_fingerprint
    )


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's weights: every tensor's name, dtype and shape, and the first
    and last 64 bytes of its data (cheap at any size, and unlike for two checkpoints)."""
    digest = hashlib.blake2b(digest_size=8)
    for name, tensor in model.state_dict().items():
        raw = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else tensor
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if tensor.numel():
            ends = torch.cat([raw[:64], raw[-64:]]).cpu().numpy().tobytes()
            digest.update(ends)
    return digest.hexdigest()


def read_blocks(caches: LayerCaches, block_ids: list[int]) -> bytes:
    """The bytes of `block_ids` (in order), each block's layers K then V."""
    if not block_ids:
        return b""
    index = torch.tensor(block_ids, dtype=torch.long, device=caches[0][0].device)
    parts = []
    for key, value in caches:
        for tensor in (key, value):
            parts.append(_as_bytes(tensor).index_select(0, index))
    stacked = torch.stack(parts, dim=1)  # [blocks, layers * 2, block bytes]
    if stacked.is_cuda:  # through a pinned host buffer: one DMA copy, then the bytes
        host = torch.empty(stacked.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(stacked)
        stacked = host
    return stacked.numpy().tobytes()


def write_blocks(caches: LayerCaches, block_ids: list[int], data: bytes) -> None:
    """Write `data` (`read_blocks`'s format) into `block_ids`, in order.

    Raises:
        ValueError: data is not whole blocks of this layout.
    """
    num_parts = 2 * len(caches)
    part_bytes = _as_bytes(caches[0][0]).shape[1]
    if len(data) != len(block_ids) * num_parts * part_bytes:
        raise ValueError(
            f"{len(data)} bytes are not {len(block_ids)} blocks of {num_parts * part_bytes}"
        )
    if not block_ids:
        return
    device = caches[0][0].device
    rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(block_ids), num_parts, -1)
    if device.type == "cuda":  # through a pinned host buffer, copied before the writes
        rows = rows.pin_memory().to(device, non_blocking=True)
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    part = 0
    for key, value in caches:
        for tensor in (key, value):
            _as_bytes(tensor).index_copy_(0, index, rows[:, part])
            part += 1


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache tensor [num_blocks, ...] seen as its bytes, [num_blocks, bytes per block]."""
    return cache.view(torch.uint8).view(cache.shape[0], -1)


# ---- the engine's side of a move ----------------------------------------------------------


def engine_layout(engine: Engine) -> KVLayout:
    """The layout of `engine`'s KV cache (computed once per engine)."""
    layout = _LAYOUTS.get(engine)
    if layout is None:
        runner = engine.runner
        dtype = format_name(runner.kv_cache_dtype)
        weights = weights_fingerprint(runner.model)
        model = model_id(engine.config.model)
        layout = layout_of(model, runner.block_size, dtype, runner.kv_caches, weights)
        _LAYOUTS[engine] = layout
    return layout


_LAYOUTS: weakref.WeakKeyDictionary[Engine, KVLayout] = weakref.WeakKeyDictionary()


def movable_engine(engine: Engine) -> str | None:
    """Why `engine`'s KV cannot move (or be taken in), or None when it can."""
    if engine.config.tensor_parallel_size > 1:
        return "a tensor-parallel engine holds each block across its ranks"
    return None


def take_sequences(engine: Engine) -> list[MovableKV]:
    """Stop every unfinished request and hand over the KV its sequences computed: the engine
    forgets them (no further output) but their blocks stay held until `release_moved`. A
    sequence with no computed block (waiting, swapped out, not forked yet), or one that still
    owes its prompt's logprobs, comes with none."""
    kv, bs = engine.kv_cache, engine.kv_cache.block_size
    _run_queued_copies(engine)
    taken: list[MovableKV] = []
    for req in list(engine.requests):
        # a request still owing its prompt's logprobs recomputes its prompt wherever it runs
        # (no cached KV stands in for them): its KV would move for nothing
        wanted = req.block_table and not req.wants_prompt_logprobs
        num_kv = req.num_computed_tokens if wanted else 0
        blocks = req.block_table[: -(-num_kv // bs)]
        kv.retain(blocks)
        taken.append(
            MovableKV(
                req.all_token_ids[:num_kv], blocks, req.cache_salt, req.session_id,
                req.request_id, req.index,
            )
        )  # fmt: skip
    for group_id in {req.group_id for req in engine.requests}:
        engine.abort(group_id)
    return taken


def idle_sessions(engine: Engine) -> list[MovableKV]:
    """Every session the engine holds (on the device, then in the host tier), most recently
    used first; their blocks stay the sessions' own (`release_moved` drops the session)."""
    kv, bs = engine.kv_cache, engine.kv_cache.block_size
    _run_queued_copies(engine)
    found = []
    for session in reversed(kv.sessions.values()):
        num_blocks = -(-len(session.token_ids) // bs)
        found.append(
            MovableKV(
                session.token_ids, session.block_ids[:num_blocks], session.cache_salt,
                session.session_id,
            )
        )  # fmt: skip
    for session in reversed(kv.host_sessions.values()):
        num_blocks = -(-len(session.token_ids) // bs)
        found.append(
            MovableKV(
                session.token_ids, session.host_block_ids[:num_blocks], session.cache_salt,
                session.session_id, on_host=True,
            )
        )  # fmt: skip
    return found


def read_moved(engine: Engine, moved: MovableKV, first: int, count: int) -> bytes:
    """The bytes of blocks first .. first + count of a sequence being moved."""
    runner = engine.runner
    block_ids = moved.block_ids[first : first + count]
    if moved.on_host:
        return read_blocks(runner.host_pool.host_caches, block_ids)
    return read_blocks(runner.kv_caches, block_ids)


def release_moved(engine: Engine, moved: MovableKV) -> None:
    """Give back what a move held: a request's blocks, or an idle session (its pins)."""
    if moved.request_id:
        engine.kv_cache.release(moved.block_ids)
    elif moved.session_id is not None:
        engine.kv_cache.release_session(moved.session_id, moved.cache_salt)


def take_blocks(engine: Engine, sender: KVLayout, num_tokens: int) -> list[int]:
    """Blocks for `num_tokens` tokens of KV coming in from a sender of layout `sender`.

    Raises:
        KVRefused: the layouts differ, or the cache has no room (the message says which).
    """
    why = movable_engine(engine) or engine_layout(engine).difference(sender)
    if why is not None:
        raise KVRefused(why)
    num_blocks = -(-num_tokens // sender.block_size)
    block_ids = engine.kv_cache.take_blocks(num_blocks)
    if block_ids is None:
        raise KVRefused(
            f"no room for {num_blocks} KV blocks ({engine.kv_cache.num_available_blocks()} "
            "free or held by idle sessions)",
            no_room=True,
        )
    _run_queued_copies(engine)  # sessions moved out of the blocks go first
    return block_ids


def _run_queued_copies(engine: Engine) -> None:
    """Run the block copies the manager queued (copies on write, swaps to and from the host
    tier) now rather than before the next step, and wait for them: blocks about to be read
    or overwritten by a move are then what the manager believes."""
    runner = engine.runner
    runner.swap_blocks(engine.kv_cache.host.take_ops())
    if runner.host_pool is not None:
        runner.host_pool.wait_all()


def write_taken(engine: Engine, block_ids: list[int], data: bytes) -> None:
    """Write blocks that `take_blocks` gave (`read_blocks`' format)."""
    write_blocks(engine.runner.kv_caches, block_ids, data)
