"""The engine's sequences by id, grouped by request (SamplingParams.n, best_of), and the checks
of a request of several sequences."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from common.choices import choice_request_id, split_choice_request_id
from common.sampling_params import MAX_N, SamplingParams
from engine.request import Request


class Sequences:
    """Every unfinished sequence, by its own id (a choice's, `common.choices`, with n > 1).

    A group's first sequence goes by the request's id until it forks, and by choice 0's
    id from then on: choice 0 run again alone (its executor was lost) may come while the
    group restarted on the same executor has not forked yet."""

    def __init__(self) -> None:
        self._by_id: dict[str, Request] = {}
        self._per_request: Counter[str] = Counter()  # live sequences per request id

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._by_id.values())

    def get(self, sequence_id: str) -> Request | None:
        return self._by_id.get(sequence_id)

    def in_use(self, request_id: str, num_sequences: int = 1) -> bool:
        """Whether a request or a sequence has this id, or, for a request of several
        sequences, one of its choices' ids, or a group not forked yet still has to fork
        the choice of this id (it has not been aborted)."""
        ids = [request_id]
        if num_sequences > 1:
            ids += [choice_request_id(request_id, i) for i in range(num_sequences)]
        return any(i in self._by_id or i in self._per_request or self._to_fork(i) for i in ids)

    def _to_fork(self, choice_id: str) -> bool:
        leader = self.leader_of(choice_id)
        return leader is not None and split_choice_request_id(choice_id)[1] not in (
            leader.unwanted_choices
        )

    def add(self, req: Request) -> None:
        self._by_id[req.request_id] = req
        self._per_request[req.group_id] += 1

    def rename(self, req: Request, sequence_id: str) -> None:
        """File `req` under `sequence_id` from now on."""
        del self._by_id[req.request_id]
        req.request_id = sequence_id
        self._by_id[sequence_id] = req

    def remove(self, req: Request) -> None:
        """Forget a sequence (one already forgotten is left alone)."""
        if self._by_id.pop(req.request_id, None) is None:
            return
        self._per_request[req.group_id] -= 1
        if not self._per_request[req.group_id]:
            del self._per_request[req.group_id]

    def of_request(self, request_id: str) -> list[Request]:
        """The live sequences of a request."""
        if request_id not in self._per_request:
            return []
        return [r for r in self._by_id.values() if r.group_id == request_id]

    def leader_of(self, choice_id: str) -> Request | None:
        """The sequence that still has to fork choice `choice_id` (or is it), if any."""
        choice = split_choice_request_id(choice_id)
        if choice is None:
            return None
        leader = self._by_id.get(choice[0])
        return leader if leader is not None and leader.num_forks else None


def check_group(
    params: SamplingParams,
    resume_token_ids: list[int] | None,
    choice_index: int,
    max_num_seqs: int,
) -> None:
    """Raises: ValueError naming the field when a request's sequences cannot run as asked."""
    num_sequences = params.num_sequences
    if num_sequences > max_num_seqs:
        name = "best_of" if params.best_of else "n"
        raise ValueError(
            f"params.{name} ({num_sequences}) must be <= max_num_seqs ({max_num_seqs}): "
            "a request's sequences run in one batch"
        )
    if isinstance(choice_index, bool) or not isinstance(choice_index, int):
        raise ValueError(f"choice_index must be an integer, got {choice_index!r}")
    if not 0 <= choice_index < MAX_N:
        raise ValueError(f"choice_index must be in [0, {MAX_N}), got {choice_index}")
    if num_sequences > 1 and choice_index:
        raise ValueError("choice_index must be 0 for a request of several sequences")
    if num_sequences > 1 and resume_token_ids:
        raise ValueError(
            "resume_token_ids: a request of several sequences resumes choice by choice "
            "(each with n = 1, its choice_index and its own tokens)"
        )
