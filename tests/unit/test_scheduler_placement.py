"""Placement of requests on executors and the executor registry."""

from __future__ import annotations

from common.prefix import block_hashes as prompt_block_hashes
from protos.kvgate.v1 import inference_pb2, internal_pb2
from scheduler.placement import Placement, Placer
from scheduler.registry import ExecutorRegistry, ExecutorReport
from scheduler.streams import StreamEntry, to_pending

BLOCK = 4


def report(eid: str, free: int = 100, running: int = 0, seq: int = 1, **kw) -> ExecutorReport:
    fields = dict(
        executor_id=eid,
        heartbeat_unix_ms=seq,
        block_size=BLOCK,
        num_free_blocks=free,
        num_total_blocks=100,
        num_running=running,
        num_waiting=0,
        draining=kw.pop("draining", False),
        **kw,
    )
    return ExecutorReport(**fields)


def cluster(*reports: ExecutorReport, load_cost_blocks: float = 1.0):
    placer = Placer(load_cost_blocks=load_cost_blocks)
    registry = ExecutorRegistry(placer)
    registry.refresh(list(reports))
    return placer, registry


def assign(
    placer: Placer,
    num_prompt_tokens: int,
    hashes: list[int],
    session_owner: str | None,
    num_sequences: int = 1,
) -> Placement | None:
    """Chooses an executor and books it, as the scheduler does once the assignment is written."""
    choice = placer.choose(num_prompt_tokens, hashes, session_owner, num_sequences)
    if choice is not None:
        placer.book(choice, hashes)
    return choice


def test_block_hashes_chain_and_are_salted_by_tenant():
    tokens = list(range(10))
    hashes = prompt_block_hashes(tokens, BLOCK, "default")
    assert len(hashes) == 2, "10 tokens in blocks of 4 make 2 full blocks"
    assert prompt_block_hashes(tokens[:8] + [99], BLOCK, "default") == hashes
    assert prompt_block_hashes([0] + tokens[1:], BLOCK, "default") == hashes
    assert prompt_block_hashes([7] + tokens[1:], BLOCK, "default")[1] != hashes[1]
    assert prompt_block_hashes(tokens, BLOCK, "other") != hashes


def test_load_spreads_over_idle_executors():
    placer, _ = cluster(report("a"), report("b"))
    chosen = [assign(placer, 8, [], None).executor_id for _ in range(4)]
    assert sorted(chosen) == ["a", "a", "b", "b"], f"expected an even spread, got {chosen}"


def test_requests_that_finish_between_reports_still_alternate():
    """Each report shows both executors idle again (the last request already finished): equal
    costs go to the executor assigned to least recently, not always to the first id."""
    placer, registry = cluster(report("a"), report("b"))
    chosen = []
    for seq in range(2, 8):
        chosen.append(assign(placer, 8, [], None).executor_id)
        registry.refresh([report("a", seq=seq), report("b", seq=seq)])
    assert chosen == ["a", "b", "a", "b", "a", "b"], f"expected alternation, got {chosen}"


def test_cache_hit_attracts_a_shared_prefix():
    placer, _ = cluster(report("a"), report("b"), load_cost_blocks=0.5)
    prefix = list(range(32))
    first = assign(placer, 33, prompt_block_hashes(prefix + [1], BLOCK, "t"), None)
    second = assign(placer, 33, prompt_block_hashes(prefix + [2], BLOCK, "t"), None)
    assert second.executor_id == first.executor_id, "the shared 8-block prefix was ignored"
    assert second.cached_blocks == 8 and second.prefill_blocks == 1


def test_session_owner_wins_while_it_can_take_the_request():
    placer, _ = cluster(report("a", running=9), report("b"))
    assert assign(placer, 8, [], session_owner="a").executor_id == "a"


def test_executor_without_free_blocks_is_skipped():
    placer, _ = cluster(report("a", free=2), report("b", free=100, running=50))
    assert assign(placer, 40, [], session_owner="a").executor_id == "b"
    placer, _ = cluster(report("a", free=2))
    assert assign(placer, 40, [], None) is None, "no executor has 11 free blocks"


def test_bookings_reset_on_the_next_heartbeat():
    placer, registry = cluster(report("a", free=5))
    assert assign(placer, 15, [], None) is not None
    assert assign(placer, 15, [], None) is None, "4 blocks booked of 5: a second 4 cannot fit"
    registry.refresh([report("a", free=5, seq=2)])
    assert assign(placer, 15, [], None) is not None


def test_a_chosen_placement_counts_only_once_booked():
    """The scheduler books a choice after writing the assignment: a request dropped as
    cancelled instead leaves no load, blocks or cache estimate behind."""
    placer, _ = cluster(report("a", free=5))
    hashes = prompt_block_hashes(list(range(16)), BLOCK, "")
    choice = placer.choose(15, hashes, None)
    assert choice is not None and placer.choose(15, hashes, None) is not None
    view = placer.executors["a"]
    assert view.load() == 0 and view.free_blocks() == 5
    assert view.prefix_index.hit_blocks(hashes) == 0 and placer.placements == 0
    placer.book(choice, hashes)
    assert placer.choose(15, hashes, None).cached_blocks == len(hashes)
    assert view.load() == 1 and placer.placements == 1


def test_registry_reports_joins_leaves_and_drains():
    placer, registry = cluster(report("a"))
    change = registry.refresh([report("a"), report("b")])
    assert change.joined == ["b"] and change.left == []
    change = registry.refresh([report("b", draining=True)])
    assert change.left == ["a"]
    assert registry.live_ids() == ["b"]
    assert assign(placer, 4, [], None) is None, "a draining executor was given work"


def test_reported_cache_contents_attract_the_prefix():
    hashes = prompt_block_hashes(list(range(16)), BLOCK, "t")
    placer, _ = cluster(report("a"), report("b", cached_block_hashes=tuple(reversed(hashes))))
    choice = assign(placer, 17, hashes, None)
    assert (choice.executor_id, choice.cached_blocks) == ("b", 4)


def test_an_executor_that_left_and_came_back_starts_with_an_empty_cache_estimate():
    placer, registry = cluster(report("a"))
    hashes = prompt_block_hashes(list(range(16)), BLOCK, "t")
    assign(placer, 17, hashes, None)
    registry.refresh([])
    registry.refresh([report("a", seq=5)])
    assert assign(placer, 17, hashes, None).cached_blocks == 0


def test_session_holder_comes_from_reports():
    _, registry = cluster(report("a"), report("b", session_ids=frozenset({"s1"})))
    assert registry.session_holder("s1") == "b" and registry.session_holder("s2") is None


def test_a_session_held_by_a_draining_executor_and_a_peer_is_the_peers():
    """A draining executor reports its sessions until it exits; once a peer that takes work
    reports one too (its KV moved there), that peer holds it."""
    moving = report("a", draining=True, moves_kv=True, session_ids=frozenset({"s1", "s2"}))
    _, registry = cluster(moving, report("b", session_ids=frozenset({"s1"})))
    assert registry.session_holder("s1") == "b"
    assert registry.session_holder("s2") == "a"  # not moved yet
    assert registry.moving_kv_from("a") and not registry.moving_kv_from("b")
    _, registry = cluster(report("a", draining=True, session_ids=frozenset({"s1"})))
    assert not registry.moving_kv_from("a")  # no KvTransfer: nothing moves, nothing to wait for


def test_a_request_of_more_sequences_than_an_executor_runs_goes_to_one_that_runs_them():
    """n (or best_of) sequences run in one batch: an executor whose max_num_seqs is smaller
    is passed over, even when it holds the session or is idler; none that runs them: None."""
    placer, _ = cluster(report("small", max_num_seqs=2), report("big", running=5, max_num_seqs=8))
    assert {assign(placer, 8, [], None, 4).executor_id for _ in range(3)} == {"big"}
    assert assign(placer, 8, [], "small", 4).executor_id == "big"
    assert assign(placer, 8, [], "small", 2).executor_id == "small"
    assert assign(placer, 8, [], None, 9) is None
    unreported, _ = cluster(report("old"))  # an executor that does not report max_num_seqs
    assert assign(unreported, 8, [], None, 16).executor_id == "old"


def test_the_scheduler_reads_a_requests_sequences_from_its_params():
    params = inference_pb2.SamplingParams(n=2, best_of=5)
    queued = internal_pb2.QueuedRequest(request_id="t/r", prompt_token_ids=[1], params=params)
    entry = StreamEntry(entry_id="1-0", payload=queued.SerializeToString(), queued_unix_us=0)
    assert to_pending(entry, block_size=BLOCK, now_s=0.0, queued_s=0.0).num_sequences == 5
    queued.params.best_of = 0
    entry = StreamEntry(entry_id="1-0", payload=queued.SerializeToString(), queued_unix_us=0)
    assert to_pending(entry, block_size=BLOCK, now_s=0.0, queued_s=0.0).num_sequences == 2
