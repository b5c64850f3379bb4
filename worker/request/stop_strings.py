"""A request's stop strings, compiled once, matched against only the text a step added.

The detokenizer asks two things after each step: does a stop string occur in the output yet,
and how long is the output's longest tail that is still a proper prefix of some stop string
(that tail is held back: a later token may complete the stop). Both answers only depend on a
window, never on the whole output:

    window = output[held_start:]   held_start = where the tail held back at the last step began

No stop occurred before this step, so an occurrence now ends in the new text; its part in the
old text is a tail of the old output that is a proper prefix of the stop, so no longer than the
tail held then: it starts in the window. The same argument bounds the new held tail. The window
is the held tail (< the longest stop) plus the new text, so a step costs O(window x stops) in
the worst case whatever the output's length, and much less in the usual one:

- matching only tries stops no longer than the window (`_by_length`): while nothing looks like
  a stop, the window is a few characters and long stops are never touched;
- the held tail is found by binary search in the sorted stops: the stops that start with a
  string P are contiguous in sorted order and the first of them is the first stop >= P, so
  "does any stop start with this tail" is one bisect per tail length, not a loop over stops.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._by_length = sorted(set(self.stops), key=len)
        self._lengths = [len(s) for s in self._by_length]
        self._sorted = sorted(set(self.stops))
        self._max_len = self._lengths[-1] if self.stops else 0

    def __bool__(self) -> bool:
        return bool(self.stops)

    def first_match(self, window: str) -> tuple[int, str] | None:
        """The earliest occurrence of a stop string in `window`: (its start, the stop); at equal
        starts the shortest stop (it ends the text first)."""
        best: tuple[int, str] | None = None
        for s in self._by_length[:bisect_right(self._lengths, len(window))]:
            at = window.find(s)
            # Shortest first: a longer stop at the same start would end the text later.
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
                if at == 0:
                    break
        return best

    def held_len(self, window: str) -> int:
        """Length of the longest tail of `window` that is a proper prefix of some stop string
        (call only when `window` holds no stop string: a whole stop is then never a tail)."""
        stops = self._sorted
        # Longest first; a proper prefix is shorter than the longest stop.
        for start in range(max(0, len(window) - self._max_len + 1), len(window)):
            tail = window[start:]
            i = bisect_left(stops, tail)
            if i < len(stops) and stops[i].startswith(tail):
                return len(window) - start
        return 0
