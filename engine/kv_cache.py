"""Paged KV cache manager: block pool, block tables, prefix cache and session pins.

Blocks are reference counted. A block with no reference is free; if it holds a full,
hashed block of tokens it stays findable in the prefix cache until it is reused
(least recently freed first). A finished request with a session id hands its blocks to
the session, which keeps them referenced until the session's next turn, `release_session`,
its TTL, or eviction under memory pressure (least recently used session first).

The sequences of one request (n, best_of) share its prompt's blocks: `fork` raises the
reference count of each, and a sequence about to write into a shared block that is not full
gets a copy of it first (copy on write, queued on `host` with the swaps, in order; without
`copy_on_write` the fork shares full blocks only and the child recomputes the partial one).

With a host tier (`num_host_blocks` > 0), KV that must leave the device is copied there
instead of being dropped: a preempted request's blocks (`swap_out`, back with `swap_in`),
and an evicted session's, which its next turn copies back. Offloaded sessions are dropped
least recently offloaded first when the host tier needs room. The copies are queued on
`host` in the order decided; the engine runs them before the next forward pass.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from common.prefix import next_block_hash
from engine.kv_swap import HostTier
from engine.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is published in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens behind block_hash, to confirm a hit


# A session's key: (its tenant's cache salt, its id). Session ids are the caller's own, so two
# tenants' sessions of one id are two sessions here too.
SessionKey = tuple[str | None, str]


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The KV cache slot that holds token `position` of a sequence with this block table."""
    return block_table[position // block_size] * block_size + position % block_size


def session_key(req: Request) -> SessionKey:
    assert req.session_id is not None
    return (req.cache_salt, req.session_id)


@dataclass(slots=True)
class Session:
    """The KV a finished turn left behind for the session's next turn."""

    session_id: str
    cache_salt: str | None
    token_ids: list[int]  # tokens whose K/V the blocks hold, in order
    block_ids: list[int]  # one reference each, owned by the session (empty when offloaded)
    last_used_s: float = 0.0
    host_block_ids: list[int] = field(default_factory=list)  # its blocks in the host tier

    @property
    def key(self) -> SessionKey:
        return (self.cache_salt, self.session_id)


@dataclass(slots=True)
class PrefixHit:
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    on_host: bool = False  # block_ids are host blocks of an offloaded session


class KVCacheManager:
    """Owns every KV block; requests and sessions hold references to them."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        session_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        num_host_blocks: int = 0,
        copy_on_write: bool = True,
    ) -> None:
        self.block_size = block_size
        self.copy_on_write = copy_on_write
        self.enable_prefix_caching = enable_prefix_caching
        self.session_ttl_s = session_ttl_s
        self._clock = clock
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_to_block: dict[int, int] = {}  # publication order
        # keyed by (tenant, id): a session id names a session of its own tenant only
        self.sessions: OrderedDict[SessionKey, Session] = OrderedDict()  # LRU first
        self.host = HostTier(num_host_blocks)
        self.host_sessions: OrderedDict[SessionKey, Session] = (
            OrderedDict()
        )  # least recently offloaded first
        self.num_evicted_blocks = 0
        self.num_evicted_sessions = 0  # dropped (their KV is gone)
        self.num_offloaded_sessions = 0  # moved to the host tier

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    # ---- hashing ------------------------------------------------------------------------

    def update_block_hashes(self, req: Request) -> None:
        """Extend `req.block_hashes` to cover every full block of its tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            tokens = req.all_token_ids[i * bs : (i + 1) * bs]
            req.block_hashes.append(next_block_hash(parent, tokens, req.cache_salt or ""))

    def register_computed_blocks(self, req: Request) -> None:
        """Publish the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(req)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        bs = self.block_size
        for i in range(req.num_registered_blocks, num_full):
            block = self.blocks[req.block_table[i]]
            block_hash = req.block_hashes[i]
            if block.block_hash is None and block_hash not in self._hash_to_block:
                block.block_hash = block_hash
                block.token_ids = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
                self._hash_to_block[block_hash] = block.block_id
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    # ---- admission ----------------------------------------------------------------------

    def acquire_cached_prefix(self, req: Request) -> int:
        """Give a request with no blocks the longest cached prefix of its tokens.

        The session's own blocks and the prefix cache are both tried; the longer hit wins. A
        hit never covers more than `Request.max_cached_tokens`. The caller
        releases the session once the request is admitted (this turn replaces it).

        Returns:
            The number of tokens whose K/V the request now holds.
        """
        assert not req.block_table and req.num_computed_tokens == 0
        max_tokens = req.max_cached_tokens
        session_hit = self._match_session(req, max_tokens)
        prefix_hit = self._match_prefix(req, max_tokens)
        hit = session_hit if session_hit.num_tokens >= prefix_hit.num_tokens else prefix_hit
        if hit.on_host:
            device_blocks = self._swap_in_session(session_key(req), hit.block_ids)
            if device_blocks is None:
                hit = prefix_hit  # no device room for the session's blocks now
            else:
                hit = PrefixHit(device_blocks, hit.num_tokens)
                req.block_table = device_blocks
                req.num_computed_tokens = hit.num_tokens
                req.num_registered_blocks = 0
                return hit.num_tokens
        for block_id in hit.block_ids:
            self._incref(block_id)
        if hit is session_hit and session_hit.num_tokens % self.block_size:
            self._unpublish(hit.block_ids[-1])  # its tail will be overwritten by this request
        req.block_table = list(hit.block_ids)
        req.num_computed_tokens = hit.num_tokens
        req.num_registered_blocks = hit.num_tokens // self.block_size if hit is prefix_hit else 0
        return hit.num_tokens

    def num_cached_prefix_tokens(self, req: Request) -> int:
        """The tokens `acquire_cached_prefix` would give the request now, taking nothing."""
        max_tokens = req.max_cached_tokens
        session_hit = self._match_session(req, max_tokens)
        return max(session_hit.num_tokens, self._match_prefix(req, max_tokens).num_tokens)

    def _match_prefix(self, req: Request, max_tokens: int) -> PrefixHit:
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        self.update_block_hashes(req)
        bs = self.block_size
        for i in range(min(max_tokens // bs, len(req.block_hashes))):
            block_id = self._hash_to_block.get(req.block_hashes[i])
            tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hit.block_ids.append(block_id)
        hit.num_tokens = len(hit.block_ids) * bs
        return hit

    def _match_session(self, req: Request, max_tokens: int) -> PrefixHit:
        session = self._find_session(req.session_id, req.cache_salt)
        if session is None:
            return PrefixHit()
        num_common = common_prefix_len(session.token_ids, req.all_token_ids, max_tokens)
        if (
            session.host_block_ids and num_common
        ):  # the copy back is the request's own: a partial block too
            num_blocks = -(-num_common // self.block_size)
            return PrefixHit(session.host_block_ids[:num_blocks], num_common, on_host=True)
        num_full = num_common // self.block_size
        block_ids = session.block_ids[:num_full]
        partial = num_common % self.block_size
        if partial and self.blocks[session.block_ids[num_full]].ref_count == 1:
            block_ids.append(session.block_ids[num_full])  # held by the session alone
        else:
            num_common = num_full * self.block_size
        return PrefixHit(block_ids, num_common)

    # ---- allocation ---------------------------------------------------------------------

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks to add to the request's table so it can hold `num_new_tokens` more."""
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of K/V; False (and no change) if full.
        A shared block the tokens would be written into is replaced by a copy of its own."""
        needed = self.num_blocks_needed(req, num_new_tokens)
        shared = self._shared_tail(req, num_new_tokens)
        if not self._make_room(needed + (shared is not None)):
            return False
        if shared is not None:
            self._copy_tail(req, shared)
        for _ in range(needed):
            req.block_table.append(self._pop_free_block())
        return True

    def trim_slots(self, req: Request) -> None:
        """Free the blocks past the request's computed tokens (allocated for proposed tokens
        that were rejected): its table is then what a step without them would have left."""
        num_kept = -(-req.num_computed_tokens // self.block_size)
        while len(req.block_table) > num_kept:
            self._decref(req.block_table.pop())

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` (a sequence with no blocks) the K/V `parent` has computed by sharing
        its blocks; whichever writes first into the shared partial block copies it."""
        assert not child.block_table
        num_tokens = parent.num_computed_tokens
        if not self.copy_on_write:
            num_tokens -= num_tokens % self.block_size
        table = parent.block_table[: -(-num_tokens // self.block_size)]
        for block_id in table:
            self._incref(block_id)
        child.block_table = list(table)
        child.num_computed_tokens = num_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = min(parent.num_registered_blocks, len(table))
        parent.shares_tail = child.shares_tail = num_tokens % self.block_size != 0

    def _shared_tail(self, req: Request, num_new_tokens: int) -> int | None:
        """The index in the table of the shared, partly filled block the next tokens would
        be written into, if any."""
        if not req.shares_tail or num_new_tokens == 0:
            return None
        offset = req.num_computed_tokens % self.block_size
        index = req.num_computed_tokens // self.block_size
        if offset == 0 or index >= len(req.block_table):
            return None
        return index if self.blocks[req.block_table[index]].ref_count > 1 else None

    def _copy_tail(self, req: Request, index: int) -> None:
        source = req.block_table[index]
        copy = self._pop_free_block()
        self.host.copy_block(source, copy)
        self._decref(source)
        req.block_table[index] = copy
        req.shares_tail = False

    def free(self, req: Request) -> None:
        """Drop the request's references; its published blocks stay in the prefix cache."""
        self.host.cancel_swap_in(req.block_table)
        for block_id in reversed(req.block_table):
            self._decref(block_id)
        self.host.free(req.host_block_table)
        req.host_block_table = []
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.shares_tail = False

    def _make_room(self, num_blocks: int) -> bool:
        """Free enough blocks by evicting sessions (LRU first), but only if that suffices."""
        if self.num_free_blocks >= num_blocks:
            return True
        if self.num_free_blocks + self._num_session_only_blocks() < num_blocks:
            return False  # evicting every session would not help: keep them
        while self.num_free_blocks < num_blocks:
            self._evict_session(next(iter(self.sessions)))
        return True

    def _make_host_room(self, num_blocks: int) -> bool:
        """Free enough host blocks by dropping offloaded sessions (least recently offloaded
        first), but only if that suffices."""
        host = self.host
        offloaded = sum(len(s.host_block_ids) for s in self.host_sessions.values())
        if host.num_free_blocks + offloaded < num_blocks:
            return False
        while host.num_free_blocks < num_blocks:
            self._release(next(iter(self.host_sessions)))
            self.num_evicted_sessions += 1
        return True

    def _num_session_only_blocks(self) -> int:
        """Blocks that releasing every session would free (no request holds them)."""
        session_refs: Counter[int] = Counter()
        for session in self.sessions.values():
            session_refs.update(session.block_ids)
        return sum(1 for b, n in session_refs.items() if self.blocks[b].ref_count == n)

    def _pop_free_block(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.pop()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            self._unpublish(block_id)
            self.num_evicted_blocks += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed twice")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._free_cached[block_id] = None
            else:
                self._free_plain.append(block_id)

    def _unpublish(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

    # ---- sessions -----------------------------------------------------------------------

    def pin_session(self, req: Request) -> None:
        """Hand a finished request's blocks to its session instead of freeing them."""
        assert req.session_id is not None
        self.release_session(req.session_id, req.cache_salt)
        num_kv_tokens = req.num_computed_tokens
        session = Session(
            session_id=req.session_id,
            cache_salt=req.cache_salt,
            token_ids=req.all_token_ids[:num_kv_tokens],
            block_ids=req.block_table,
            last_used_s=self._clock(),
            host_block_ids=req.host_block_table,
        )
        # a request that finished while swapped out starts its session in the host tier
        (self.host_sessions if req.host_block_table else self.sessions)[session.key] = session
        req.block_table = []
        req.host_block_table = []
        req.num_computed_tokens = 0

    def release_session(self, session_id: str, cache_salt: str | None = None) -> bool:
        """Drop the pins of the session `session_id` of the tenant `cache_salt` (another
        tenant's session of the same id stays).

        Returns:
            Whether a session was released.
        """
        return self._release((cache_salt, session_id))

    def _release(self, key: SessionKey) -> bool:
        session = self.sessions.pop(key, None) or self.host_sessions.pop(key, None)
        if session is None:
            return False
        if session.host_block_ids:
            self.host.free(session.host_block_ids)
        for block_id in reversed(session.block_ids):
            self._decref(block_id)
        return True

    def _find_session(self, session_id: str | None, cache_salt: str | None) -> Session | None:
        if session_id is None:
            return None
        key = (cache_salt, session_id)
        return self.sessions.get(key) or self.host_sessions.get(key)

    def expire_sessions(self) -> int:
        """Release sessions idle longer than `session_ttl_s`; returns how many."""
        deadline = self._clock() - self.session_ttl_s
        every = (*self.sessions.values(), *self.host_sessions.values())
        expired = [s.key for s in every if s.last_used_s < deadline]
        for key in expired:
            self._release(key)
        return len(expired)

    def _evict_session(self, key: SessionKey) -> None:
        """Move a device session to the host tier if it has room, else drop it."""
        session = self.sessions[key]
        if not self._make_host_room(len(session.block_ids)):
            self._release(key)
            self.num_evicted_sessions += 1
            return
        del self.sessions[key]
        session.host_block_ids = self.host.swap_out(session.block_ids)
        for block_id in reversed(session.block_ids):
            self._decref(block_id)
        session.block_ids = []
        self.host_sessions[key] = session
        self.num_offloaded_sessions += 1

    def _swap_in_session(self, key: SessionKey, host_blocks: list[int]) -> list[int] | None:
        """Device blocks holding a copy of `host_blocks` of an offloaded session (which keeps
        its host blocks until the turn is admitted), or None when the device has no room."""
        session = self.host_sessions.pop(key)  # kept out of reach of _make_host_room
        try:
            if not self._make_room(len(host_blocks)):
                return None
            device_blocks = [self._pop_free_block() for _ in host_blocks]
            self.host.swap_in(host_blocks, device_blocks)
            return device_blocks
        finally:
            self.host_sessions[key] = session

    # ---- preemption to the host tier ----------------------------------------------------

    def swap_out(self, req: Request) -> bool:
        """Move a request's computed K/V to the host tier and free its device blocks; it keeps
        `num_computed_tokens`. False (and no change) when the host tier has no room."""
        num_blocks = -(-req.num_computed_tokens // self.block_size)
        if not self._make_host_room(num_blocks):
            return False
        req.host_block_table = self.host.swap_out(req.block_table[:num_blocks])
        for block_id in reversed(req.block_table):
            self._decref(block_id)
        req.block_table = []
        req.num_registered_blocks = 0
        req.shares_tail = False
        return True

    def swap_in(self, req: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request's blocks back to the device, with room for
        `num_new_tokens` more tokens; False (and no change) when the device has no room."""
        assert req.host_block_table and not req.block_table
        total = req.num_computed_tokens + num_new_tokens
        if not self._make_room(-(-total // self.block_size)):
            return False
        req.block_table = [self._pop_free_block() for _ in req.host_block_table]
        self.host.swap_in(req.host_block_table, req.block_table)
        self.host.free(req.host_block_table)
        req.host_block_table = []
        if not self.allocate_slots(req, num_new_tokens):  # room was made above
            raise RuntimeError(f"no room for {req.request_id}'s blocks after making room")
        return True

    # ---- KV that moves between engines (engine/kv_move.py) ------------------------------

    def retain(self, block_ids: list[int]) -> None:
        """Hold a reference to each block (a move reads them after their owner let go)."""
        for block_id in block_ids:
            self._incref(block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drop references `retain` or `take_blocks` gave."""
        for block_id in reversed(block_ids):
            self._decref(block_id)

    def take_blocks(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` blocks for KV coming from a peer (evicting idle sessions if that
        makes room), one reference each; None (and no change) when there is no room."""
        if not self._make_room(num_blocks):
            return None
        return [self._pop_free_block() for _ in range(num_blocks)]

    def adopt(
        self,
        block_ids: list[int],
        token_ids: list[int],
        cache_salt: str | None,
        session_id: str | None,
    ) -> None:
        """Take in blocks `take_blocks` gave, now holding the K/V of `token_ids`: their full
        blocks are published in the prefix cache, and with `session_id` they become that
        session's pins (replacing a session of the key held here), else they are freed,
        findable by their hashes until reused."""
        bs = self.block_size
        if self.enable_prefix_caching:
            parent = None
            for i in range(len(token_ids) // bs):
                tokens = token_ids[i * bs : (i + 1) * bs]
                parent = next_block_hash(parent, tokens, cache_salt or "")
                block = self.blocks[block_ids[i]]
                if block.block_hash is None and parent not in self._hash_to_block:
                    block.block_hash = parent
                    block.token_ids = tuple(tokens)
                    self._hash_to_block[parent] = block.block_id
        if session_id is None:
            self.release(block_ids)
            return
        self._release((cache_salt, session_id))
        session = Session(session_id, cache_salt, list(token_ids), list(block_ids), self._clock())
        self.sessions[session.key] = session

    def cached_block_hashes(self, limit: int) -> list[int]:
        """Hashes of the most recently published blocks still in the prefix cache, newest first."""
        newest = reversed(self._hash_to_block)
        return [h for h, _ in zip(newest, range(limit), strict=False)]

    def num_available_blocks(self) -> int:
        """Blocks a request could get now: the free ones and those only idle sessions hold
        (evicted, or moved to the host tier, on demand)."""
        return self.num_free_blocks + self._num_session_only_blocks()

    def num_session_blocks(self) -> int:
        """Device blocks held by sessions (a block shared by two sessions counts twice)."""
        return sum(len(s.block_ids) for s in self.sessions.values())

    def session_ids(self) -> list[str]:
        """Sessions whose KV this manager holds, on the device or in the host tier."""
        return [session_id for _, session_id in (*self.sessions, *self.host_sessions)]


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
