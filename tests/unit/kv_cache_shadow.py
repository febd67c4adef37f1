"""The shadow copy of the KV pool that test_kv_cache_stateful.py's state machine keeps, and
the checks it makes of KVCacheManager against it.

A slot of the shadow holds (cache salt, tokens up to and including its position): what the
K/V written there depends on. `ShadowChecks` is mixed into the state machine, which owns the
state it reads: `kv`, `bs`, `shadow`, `shadow_host`, `running`, `waiting`, `pinned`,
`hash_contents` and `num_evicted_sessions`.
"""

from __future__ import annotations

from engine.kv_cache import KVCacheManager, Session
from engine.request import Request

Content = tuple[str | None, tuple[int, ...]]  # (cache salt, tokens up to the slot's position)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def content_at(salt: str | None, token_ids: list[int], position: int) -> Content:
    return (salt, tuple(token_ids[: position + 1]))


class ShadowChecks:
    """What the KV cache must hold, checked against the shadow pool."""

    kv: KVCacheManager
    bs: int
    shadow: list[list[Content | None]]
    shadow_host: list[list[Content | None]]
    running: list[Request]
    waiting: list[Request]
    pinned: dict[tuple[str | None, str], tuple[str | None, list[int], float]]
    hash_contents: dict[int, Content]
    num_evicted_sessions: int

    def assert_holds_own_kv(self, req: Request, num_tokens: int, what: str) -> None:
        shadow = self.shadow_after_queued_swaps()
        for p in range(num_tokens):
            block_id = req.block_table[p // self.bs]
            got = shadow[block_id][p % self.bs]
            want = content_at(req.cache_salt, req.all_token_ids, p)
            assert got == want, (
                f"{what}: {req.request_id} position {p} (block {block_id}) should hold K/V of "
                f"{want}, but the slot holds K/V of {got}"
            )

    def shadow_after_queued_swaps(self) -> list[list[Content | None]]:
        """The device shadow as the copies queued now would leave it (they stay queued, so a
        request that lets its blocks go still cancels them)."""
        ops = self.kv.host._ops
        if not ops:
            return self.shadow
        device, host = list(self.shadow), list(self.shadow_host)
        for op in ops:
            if op.to_host:
                host[op.host_block] = device[op.device_block]
            else:
                device[op.device_block] = host[op.host_block]
        return device

    def run_swaps(self) -> None:
        """Run the copies the manager queued between the tiers, in order, on the shadow."""
        for op in self.kv.host.take_ops():
            if op.to_host:
                self.shadow_host[op.host_block] = list(self.shadow[op.device_block])
            else:
                self.shadow[op.device_block] = list(self.shadow_host[op.host_block])

    def assert_host_holds(self, host_blocks: list[int], salt, tokens: list[int], what: str):
        for p in range(len(tokens)):
            got = self.shadow_host[host_blocks[p // self.bs]][p % self.bs]
            want = content_at(salt, tokens, p)
            assert got == want, f"{what} position {p} should hold K/V of {want}, holds {got}"

    def all_sessions(self) -> list[Session]:
        """Sessions on the device, then those offloaded to the host tier."""
        return [*self.kv.sessions.values(), *self.kv.host_sessions.values()]

    def check_host_blocks_have_one_owner_each(self) -> None:
        owned = [b for r in self.waiting for b in r.host_block_table]
        owned += [b for s in self.kv.host_sessions.values() for b in s.host_block_ids]
        free = self.kv.host._free
        assert sorted(owned + free) == list(range(self.kv.host.num_blocks)), (
            f"host blocks owned {sorted(owned)} and free {sorted(free)} should each be one of "
            f"{self.kv.host.num_blocks}, once"
        )
        for req in self.running:
            assert not req.host_block_table, f"running {req.request_id} holds host blocks"

    def write_kv(self, req: Request, start: int, stop: int) -> None:
        for p in range(start, stop):
            block_id = req.block_table[p // self.bs]
            self.shadow[block_id][p % self.bs] = content_at(req.cache_salt, req.all_token_ids, p)

    def record_hashes(self, req: Request) -> None:
        for i, block_hash in enumerate(req.block_hashes):
            want = (req.cache_salt, tuple(req.all_token_ids[: (i + 1) * self.bs]))
            seen = self.hash_contents.setdefault(block_hash, want)
            assert seen == want, f"one block hash names both {seen} and {want}"

    def account_for_evicted_sessions(self) -> None:
        """Sessions may vanish only by eviction under pressure, and each one is counted."""
        left = {s.key for s in self.all_sessions()}
        vanished = [key for key in self.pinned if key not in left]
        evicted = self.kv.num_evicted_sessions - self.num_evicted_sessions
        assert len(vanished) == evicted, (
            f"sessions {vanished} vanished but {evicted} evictions were counted"
        )
        # with a host tier, a session too big for it is dropped from the device while older
        # offloaded ones stay: least recent first holds on each tier, not across them
        lru_first = list(self.pinned)[: len(vanished)]
        if not self.kv.host.num_blocks:
            assert vanished == lru_first, (
                f"evicted {vanished}, but the least recent were {lru_first}"
            )
        for key in vanished:
            del self.pinned[key]
        self.num_evicted_sessions = self.kv.num_evicted_sessions

    def holders(self) -> list[tuple[str, str | None, list[int]]]:
        held = [(r.request_id, r.cache_salt, r.block_table) for r in self.running + self.waiting]
        held += [(f"session {s.session_id}", s.cache_salt, s.block_ids) for s in self.sessions()]
        return held

    def sessions(self) -> list[Session]:
        return list(self.kv.sessions.values())

    def check_ref_counts_match_references(self) -> None:
        refs = [0] * self.kv.num_blocks
        for _, _, block_ids in self.holders():
            for block_id in block_ids:
                refs[block_id] += 1
        got = [b.ref_count for b in self.kv.blocks]
        assert got == refs, f"ref counts should be {refs}, are {got}"

    def check_free_lists_hold_each_free_block_once(self) -> None:
        plain = list(self.kv._free_plain)
        cached = list(self.kv._free_cached)
        free = plain + cached
        want = [b.block_id for b in self.kv.blocks if b.ref_count == 0]
        assert sorted(free) == want, f"free lists should hold {want}, hold {sorted(free)}"
        for block_id in plain:
            assert self.kv.blocks[block_id].block_hash is None, (
                f"block {block_id} is published but on the plain free list (reused unhashed)"
            )
        for block_id in cached:
            assert self.kv.blocks[block_id].block_hash is not None, (
                f"block {block_id} is on the cached free list but not published"
            )

    def check_blocks_are_never_shared_across_salts(self) -> None:
        salt_of: dict[int, tuple[str, str | None]] = {}
        for holder, salt, block_ids in self.holders():
            for block_id in block_ids:
                other = salt_of.setdefault(block_id, (holder, salt))
                assert other[1] == salt, (
                    f"block {block_id} is held by {holder} (salt {salt!r}) and by {other[0]} "
                    f"(salt {other[1]!r})"
                )

    def check_requests_hold_their_own_kv(self) -> None:
        for req in self.running:
            self.assert_holds_own_kv(req, req.num_computed_tokens, "running request")
        for req in self.waiting:
            assert not req.block_table, f"waiting {req.request_id} holds {req.block_table}"
            if req.host_block_table:  # swapped out
                tokens = req.all_token_ids[: req.num_computed_tokens]
                assert len(req.host_block_table) == -(-len(tokens) // self.bs)
                self.assert_host_holds(req.host_block_table, req.cache_salt, tokens,
                                       f"swapped-out {req.request_id}")  # fmt: skip
            else:
                assert req.num_computed_tokens == 0, f"waiting {req.request_id} computed tokens"

    def check_sessions_hold_their_turns_kv(self) -> None:
        self.account_for_evicted_sessions()
        last_used = [s.last_used_s for s in self.sessions()]
        assert last_used == sorted(last_used), f"sessions out of LRU order: {last_used}"
        for s in self.sessions():
            assert s.key in self.pinned, f"session {s.key} appeared from nowhere"
            salt, tokens, pinned_at = self.pinned[s.key]
            assert (s.cache_salt, s.token_ids, s.last_used_s) == (salt, tokens, pinned_at)
            assert len(s.block_ids) * self.bs >= len(tokens)
            for p in range(len(tokens)):
                got = self.shadow[s.block_ids[p // self.bs]][p % self.bs]
                want = content_at(salt, tokens, p)
                assert got == want, (
                    f"session {s.session_id} position {p} should hold K/V of {want}, holds {got}"
                )
        for s in self.kv.host_sessions.values():
            assert s.key in self.pinned, f"session {s.key} appeared from nowhere"
            salt, tokens, pinned_at = self.pinned[s.key]
            assert (s.cache_salt, s.token_ids, s.last_used_s) == (salt, tokens, pinned_at)
            assert not s.block_ids, f"offloaded session {s.session_id} holds device blocks"
            self.assert_host_holds(s.host_block_ids, salt, tokens, f"offloaded {s.session_id}")

    def check_published_blocks_hold_what_their_hash_names(self) -> None:
        for req in self.running + self.waiting:
            self.record_hashes(req)
        for block_hash, block_id in self.kv._hash_to_block.items():
            block = self.kv.blocks[block_id]
            assert block.block_hash == block_hash, f"block {block_id} has lost its hash"
            assert block_hash in self.hash_contents, f"block {block_id} published a stray hash"
            salt, prefix = self.hash_contents[block_hash]
            start = len(prefix) - self.bs
            assert block.token_ids == prefix[start:], (
                f"block {block_id} confirms hits with {block.token_ids}, hash names {prefix}"
            )
            for slot in range(self.bs):
                got = self.shadow[block_id][slot]
                want = (salt, prefix[: start + slot + 1])
                assert got == want, (
                    f"published block {block_id} slot {slot} should hold K/V of {want}, holds {got}"
                )
        published = {b.block_id for b in self.kv.blocks if b.block_hash is not None}
        assert published == set(self.kv._hash_to_block.values())
