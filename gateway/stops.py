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
    stopped: bool  # a stop string matched; `text` ends right before it (or with it, when kept)


class StopStringMatcher:
    """Finds the first occurrence of any stop string in a stream of text deltas."""

    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        """Args:
        stop: the stop strings.
        include_stop: end the text with the matched stop string instead of before it.
        """
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.held = ""
        self.matched = ""  # the stop string that matched, once one has

    def feed(self, delta: str) -> StopResult:
        """Add a delta; return the text that can be emitted and whether a stop matched."""
        pending = self.held + delta
        match = self._first_match(pending)
        if match is not None:
            self.held = ""
            match_at, stop = match
            self.matched = stop
            end = match_at + len(stop) if self.include_stop else match_at
            return StopResult(pending[:end], stopped=True)
        keep = self._partial_match_len(pending)
        self.held = pending[len(pending) - keep :]
        return StopResult(pending[: len(pending) - keep], stopped=False)

    def flush(self) -> str:
        """Return the held-back text (the stream ended without a match)."""
        held, self.held = self.held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string starts and which it is (the longest at one place)."""
        found = [(i, -len(s), s) for s in self.stop if (i := text.find(s)) >= 0]
        if not found:
            return None
        at, _, stop = min(found)
        return at, stop

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
