"""Placement of requests on executors: session affinity, then the cheapest executor.

cost = prompt blocks still to prefill after the executor's cache hit
       + load_cost_blocks * (running + waiting + assigned since its last report)

among executors whose free blocks (reported, less what was assigned since)
can take the request and that run as many sequences at once as it has (n or best_of: a
request's sequences run in one batch); between equal costs, the executor assigned to least
recently.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class PrefixIndex:
    """What the scheduler believes one executor has cached: an LRU of block hashes.

    Hashes are `common.prefix.block_hashes` of prompts: the ones the executor
    reports in its heartbeat plus the ones assigned to it since. It is an
    estimate; the executor's own cache decides what is really reused.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self._capacity = max(1, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def resize(self, capacity_blocks: int) -> None:
        self._capacity = max(1, capacity_blocks)
        self._evict()

    def hit_blocks(self, block_hashes: list[int]) -> int:
        """Returns: the number of leading blocks of the prompt believed cached."""
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                break
            hits += 1
        return hits

    def record(self, block_hashes: list[int]) -> None:
        """Marks a prompt's blocks as cached (most recently used)."""
        for block_hash in block_hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        self._evict()

    def _evict(self) -> None:
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)


@dataclass(slots=True)
class ExecutorView:
    """The scheduler's view of one live executor."""

    executor_id: str
    block_size: int
    num_free_blocks: int  # as last reported
    num_total_blocks: int
    num_running: int
    num_waiting: int
    prefix_index: PrefixIndex
    max_num_seqs: int = 0  # most sequences it runs at once (0: not reported)
    assigned_blocks: int = 0  # blocks of requests assigned since its last report
    assigned_requests: int = 0  # requests assigned since its last report
    last_placement: int = 0  # Placer.placements when it last got a request (0: never)

    def free_blocks(self) -> int:
        return self.num_free_blocks - self.assigned_blocks

    def load(self) -> int:
        return self.num_running + self.num_waiting + self.assigned_requests


@dataclass(slots=True)
class Placement:
    """Where one request goes and what it is expected to cost there."""

    executor_id: str
    prefill_blocks: int  # blocks still to prefill after the expected cache hit
    cached_blocks: int


@dataclass(slots=True)
class Placer:
    """Chooses an executor for each request and books the choice until the next report."""

    load_cost_blocks: float
    executors: dict[str, ExecutorView] = field(default_factory=dict)
    placements: int = 0  # requests placed so far

    def choose(
        self,
        num_prompt_tokens: int,
        block_hashes: list[int],
        session_owner: str | None,
        num_sequences: int = 1,
    ) -> Placement | None:
        """Args: the prompt's length and block hashes, the executor holding its session, and
        how many sequences the request runs at once.

        Returns: the best placement (not booked yet), None when no executor can take it.
        """
        candidates = [
            self._price(view, num_prompt_tokens, block_hashes)
            for view in self.executors.values()
            if not view.max_num_seqs or num_sequences <= view.max_num_seqs
        ]
        fitting = [p for p in candidates if p is not None]
        if not fitting:
            return None
        owned = [p for p in fitting if p.executor_id == session_owner]
        return owned[0] if owned else min(fitting, key=self._cost)

    def cached_blocks(self, block_hashes: list[int]) -> int:
        """Returns: the most leading blocks of the prompt any executor is believed to hold."""
        views = self.executors.values()
        return max((v.prefix_index.hit_blocks(block_hashes) for v in views), default=0)

    def _price(
        self, view: ExecutorView, num_prompt_tokens: int, block_hashes: list[int]
    ) -> Placement | None:
        num_blocks = -(-(num_prompt_tokens + 1) // view.block_size)
        cached = view.prefix_index.hit_blocks(block_hashes)
        prefill_blocks = num_blocks - cached
        if prefill_blocks > view.free_blocks():
            return None
        return Placement(view.executor_id, prefill_blocks=prefill_blocks, cached_blocks=cached)

    def _cost(self, placement: Placement) -> tuple[float, int, str]:
        view = self.executors[placement.executor_id]
        cost = placement.prefill_blocks + self.load_cost_blocks * view.load()
        return (cost, view.last_placement, placement.executor_id)

    def book(self, placement: Placement, block_hashes: list[int]) -> None:
        """Counts an assigned request against its executor until the executor's next report."""
        view = self.executors[placement.executor_id]
        view.assigned_blocks += placement.prefill_blocks
        view.assigned_requests += 1
        view.prefix_index.record(block_hashes)
        self.placements += 1
        view.last_placement = self.placements
