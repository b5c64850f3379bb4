"""Rank 0 of a tensor-parallel worker: one answer from N ranks' KV transfers.

Every rank's connector (connector.KVConnector) moves only its own shard's bytes; the scheduler,
on rank 0, must see one outcome per request. This folds the followers' reports (tp_link.py's
"pulled" and "unpinned" messages) into that outcome:

- a pull is done when rank 0's own part and every follower's are, and failed if any part failed
  (then all ranks fall back to local prefill together: no request runs on half its heads);
- a pinned request's blocks are free only when every rank's pin is gone (a decode rank may still
  be reading rank r's shard after rank 0's part was read).

Pure bookkeeping, no I/O: the connector calls it from its step thread (vLLM keeps the same
concept as its KV output aggregator).
"""

from __future__ import annotations


class RankAggregator:
    def __init__(self, followers: int):
        self.followers = followers  # ranks 1..N-1
        self._pulling: dict[str, set[int]] = {}  # request -> followers still pulling
        self._failed: dict[str, str] = {}  # request -> why a follower's part failed
        self._unpinned: dict[str, int] = {}  # pin -> followers whose pin is gone
        self._gone_here: set[str] = set()  # pins rank 0 no longer holds, followers' not yet all gone

    def pull_started(self, rid: str) -> None:
        self._pulling[rid] = set(range(1, self.followers + 1))

    def report(self, msg: tuple) -> None:
        """One follower message: ("pulled", rank, rid, error | None) or ("unpinned", rank, rid)."""
        if msg[0] == "pulled":
            _, rank, rid, error = msg
            self._pulling.get(rid, set()).discard(rank)
            if error is not None:
                self._failed.setdefault(rid, f"rank {rank}: {error}")
        elif msg[0] == "unpinned":
            self._unpinned[msg[2]] = self._unpinned.get(msg[2], 0) + 1

    def followers_pulling(self, rid: str) -> bool:
        return bool(self._pulling.get(rid))

    def finish_pull(self, rid: str) -> str | None:
        """Forget a pull every rank has finished; why a follower's part failed, if one did."""
        self._pulling.pop(rid, None)
        return self._failed.pop(rid, None)

    def pin_gone_here(self, rid: str) -> None:
        self._gone_here.add(rid)

    def sent(self) -> list[str]:
        """Pins now gone on every rank (each returned once): their blocks may be freed."""
        done = [r for r in self._gone_here if self._unpinned.get(r, 0) >= self.followers]
        for rid in done:
            self._gone_here.discard(rid)
            self._unpinned.pop(rid, None)
        return done
