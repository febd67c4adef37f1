"""Stop strings: cut the streamed text before the first match.

Text that could be the start of a stop string is held back until the next
delta shows whether it is one, so no emitted text ever has to be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopResult:
    """What to emit after one delta."""

    text: str  # text safe to send now
    stopped: bool  # a stop string matched; `text` ends right before it


class StopStringMatcher:
    """Finds the first occurrence of any stop string in a stream of text deltas."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.held = ""
        self.matched = ""  # the stop string that matched, once one has

    def feed(self, delta: str) -> StopResult:
        """Add a delta; return the text that can be emitted and whether a stop matched."""
        pending = self.held + delta
        match_at = self._first_match(pending)
        if match_at is not None:
            self.held = ""
            self.matched = next(s for s in self.stop if pending.find(s) == match_at)
            return StopResult(pending[:match_at], stopped=True)
        keep = self._partial_match_len(pending)
        self.held = pending[len(pending) - keep :]
        return StopResult(pending[: len(pending) - keep], stopped=False)

    def flush(self) -> str:
        """Return the held-back text (the stream ended without a match)."""
        held, self.held = self.held, ""
        return held

    def _first_match(self, text: str) -> int | None:
        positions = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(positions, default=None)

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
