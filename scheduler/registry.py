"""The executors the scheduler may place on, kept current from their heartbeats."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.placement import ExecutorView, Placer, PrefixIndex


@dataclass(slots=True, frozen=True)
class ExecutorReport:
    """One executor heartbeat, as the scheduler uses it."""

    executor_id: str
    heartbeat_unix_ms: int  # when the executor took this report
    block_size: int
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    draining: bool  # finishing its work, takes no more
    moves_kv: bool = False  # serves KvTransfer: a drain moves its sessions to peers
    session_ids: frozenset[str] = frozenset()  # sessions whose KV it holds
    cached_block_hashes: tuple[int, ...] = ()  # prefix blocks it holds, most recent first
    max_num_seqs: int = 0  # most sequences it runs at once (0: not reported)


@dataclass(slots=True)
class RegistryChange:
    """What one refresh of the registry changed."""

    joined: list[str]
    left: list[str]  # gone (heartbeat expired or stopped): its unread inbox must be re-queued


class ExecutorRegistry:
    """Tracks live executors and feeds the placer the ones that take work."""

    def __init__(self, placer: Placer) -> None:
        self._placer = placer
        self._reports: dict[str, ExecutorReport] = {}

    def live_ids(self) -> list[str]:
        return sorted(self._reports)

    def session_holder(self, session_id: str) -> str | None:
        """Returns: a live executor reporting that it holds the session, if any (one that
        takes work first: a draining executor reports its sessions until it exits)."""
        holders = [r for r in self._reports.values() if session_id in r.session_ids]
        holders.sort(key=lambda r: r.draining)
        return holders[0].executor_id if holders else None

    def moving_kv_from(self, executor_id: str) -> bool:
        """Whether `executor_id` is alive and draining with KvTransfer: its sessions are on
        their way to peers, which report them once they hold them."""
        report = self._reports.get(executor_id)
        return report is not None and report.draining and report.moves_kv

    def refresh(self, reports: list[ExecutorReport]) -> RegistryChange:
        """Args: the heartbeats currently alive. Returns: which executors joined and left."""
        current = {r.executor_id: r for r in reports}
        left = [eid for eid in self._reports if eid not in current]
        joined = [eid for eid in current if eid not in self._reports]
        for executor_id in left:
            self._forget(executor_id)
        for report in current.values():
            self._apply(report)
        return RegistryChange(joined=joined, left=left)

    def _forget(self, executor_id: str) -> None:
        self._reports.pop(executor_id, None)
        self._placer.executors.pop(executor_id, None)

    def _apply(self, report: ExecutorReport) -> None:
        previous = self._reports.get(report.executor_id)
        self._reports[report.executor_id] = report
        if report.draining:
            self._placer.executors.pop(report.executor_id, None)
            return
        view = self._placer.executors.get(report.executor_id)
        if view is None:
            view = self._new_view(report)
            self._placer.executors[report.executor_id] = view
        elif previous is not None and previous.heartbeat_unix_ms == report.heartbeat_unix_ms:
            return
        self._update_view(view, report)

    def _new_view(self, report: ExecutorReport) -> ExecutorView:
        return ExecutorView(
            executor_id=report.executor_id,
            block_size=report.block_size,
            num_free_blocks=report.num_free_blocks,
            num_total_blocks=report.num_total_blocks,
            num_running=report.num_running,
            num_waiting=report.num_waiting,
            prefix_index=PrefixIndex(report.num_total_blocks),
            max_num_seqs=report.max_num_seqs,
        )

    @staticmethod
    def _update_view(view: ExecutorView, report: ExecutorReport) -> None:
        view.num_free_blocks = report.num_free_blocks
        view.num_total_blocks = report.num_total_blocks
        view.num_running = report.num_running
        view.num_waiting = report.num_waiting
        view.max_num_seqs = report.max_num_seqs
        view.assigned_blocks = 0
        view.assigned_requests = 0
        view.prefix_index.resize(report.num_total_blocks)
        view.prefix_index.record(list(reversed(report.cached_block_hashes)))
