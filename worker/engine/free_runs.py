"""Free block ids kept as maximal runs (extents), so an allocation finds a long run without a scan.

Invariants: `mask[b] == 1` iff b is free; every free id lies in exactly one run; runs are
maximal (no two touch: freeing a block merges it with its neighbours). Each run is indexed by
its start, by its end (exclusive) and by its length; the distinct lengths are kept sorted. At
most about sqrt(2 * num_blocks) lengths can coexist (runs are disjoint), so that sorted list
stays a few hundred entries long even for a 100k-block cache and its insertions are cheap.

Costs: `put` O(log n); `take(n)` O(n + runs taken * log n); `take_from(b, n)` O(n);
`take_block(b)` O(length of b's run) (a C scan of `mask`).
"""

from __future__ import annotations

from bisect import bisect_left, insort


class FreeRuns:
    def __init__(self, num_blocks: int):
        self.mask = bytearray(b"\x01") * num_blocks
        self.num_free = 0
        self._len_at: dict[int, int] = {}  # run start -> length
        self._start_of: dict[int, int] = {}  # run end (exclusive) -> start
        self._starts_by_len: dict[int, set[int]] = {}
        self._lens: list[int] = []  # distinct run lengths, ascending
        if num_blocks:
            self._add(0, num_blocks)

    def __len__(self) -> int:
        return self.num_free

    def runs(self) -> list[tuple[int, int]]:
        """[(start, length)] in ascending order (tests and benchmarks; O(runs log runs))."""
        return sorted(self._len_at.items())

    def take(self, n: int) -> list[int]:
        """n free ids in the fewest runs: the shortest run holding all that is left (best fit,
        so long runs stay whole for long requests), else the longest run whole, and again."""
        if n > self.num_free:
            raise ValueError(f"{n} blocks asked, {self.num_free} free")
        taken: list[int] = []
        while len(taken) < n:
            left = n - len(taken)
            i = bisect_left(self._lens, left)
            length = self._lens[i] if i < len(self._lens) else self._lens[-1]
            start = self._starts_by_len[length].pop()  # O(1); next(iter(set)) is not, after removals
            taken.extend(self._cut(start, min(left, length)))
        return taken

    def take_from(self, b: int, n: int) -> list[int]:
        """Up to n ids b, b+1, ... where b starts a run (a request growing past its last block)."""
        length = self._len_at.get(b)
        return self._cut(b, min(n, length)) if length else []

    def take_block(self, b: int) -> None:
        """Take the free id b, splitting its run."""
        start = self.mask.rfind(b"\x00", 0, b) + 1
        length = self._len_at[start]
        self._remove(start, length)
        self.mask[b] = 0
        if b > start:
            self._add(start, b - start)
        if start + length > b + 1:
            self._add(b + 1, start + length - b - 1)

    def put(self, b: int) -> None:
        """Free b, merging it with the runs ending at b and starting at b + 1."""
        if self.mask[b]:
            raise ValueError(f"block {b} is already free")
        start, end = b, b + 1
        left = self._start_of.get(b)
        if left is not None:
            self._remove(left, b - left)
            start = left
        right = self._len_at.get(b + 1)
        if right is not None:
            self._remove(b + 1, right)
            end = b + 1 + right
        self.mask[b] = 1
        self._add(start, end - start)

    def _cut(self, start: int, n: int) -> range:
        """Take the first n ids of the run at start; the rest stays a run."""
        length = self._len_at[start]
        self._remove(start, length)
        self.mask[start:start + n] = bytes(n)
        if n < length:
            self._add(start + n, length - n)
        return range(start, start + n)

    def _add(self, start: int, length: int) -> None:
        """Index a run (its ids are marked free in mask); num_free counts indexed runs only."""
        self._len_at[start] = length
        self._start_of[start + length] = start
        starts = self._starts_by_len.get(length)
        if starts is None:
            self._starts_by_len[length] = starts = set()
            insort(self._lens, length)
        starts.add(start)
        self.num_free += length

    def _remove(self, start: int, length: int) -> None:
        del self._len_at[start]
        del self._start_of[start + length]
        starts = self._starts_by_len[length]
        starts.discard(start)  # take() may have popped it already
        if not starts:
            del self._starts_by_len[length]
            del self._lens[bisect_left(self._lens, length)]
        self.num_free -= length
