"""The KV connector across the ranks of one tensor-parallel worker: rank 0 decides, every rank moves bytes.

The scheduler half lives on rank 0 only (it owns requests and blocks); the worker half
(connector.KVConnector) runs on every rank over that rank's cache shard. They talk over one
duplex pipe per follower (made by executor/tp_ranks.TPFollowers beside its step pipe), read on the
follower by a thread of its own, so a pin is mirrored at once even while the rank runs a step.

rank 0 -> rank r
  ("init", engine_id, layout)                   build rank r's connector (and, on a prefill
                                                worker, its side channel on --kv-port + r)
  ("orders", KVConnectorMetadata)               the scheduler half's orders of a step, as rank 0
                                                carries them out (connector_meta.py), before any
                                                params they describe leave the worker: mirror the
                                                pin table's changes (a streamed pin's `advance`
                                                comes after the step's collectives tied every
                                                rank's KV writes), pull this rank's heads of the
                                                loads, stop aborted pulls. Releases of remote pins
                                                stay on rank 0 (it releases every remote rank).
rank r -> rank 0
  ("applied", r)                                rank r carried out orders that made pins (rank 0
                                                waits for every rank's before their params leave:
                                                a reader may reach rank r at once)
  ("pulled", r, rid, error or None)             rank r's pull of rid landed (or failed)
  ("unpinned", r, rid)                          rank r's pin of rid was released or expired

Rank 0 reports a pull to the scheduler only when every rank has (failed if any rank failed,
so all ranks fall back to local prefill together), and frees a pinned request's blocks only
when every rank's pin is gone (a decode rank may still be reading rank r's shard): the
follower reports are folded by rank_aggregator.RankAggregator.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import threading
import time

from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.kv.tp_transfer import TPRank

log = logging.getLogger(__name__)


def needs_kv_connector(config: EngineConfig) -> bool:
    """The same rule as the engine's: a plain worker (role both, no --kv-transfer) moves no KV."""
    return config.role != "both" or config.kv_transfer is not None


# How long rank 0 waits for every rank to mirror new pins; past it a rank is taken to be dying
# (the TP watchdog ends the worker) and the params leave anyway.
ACK_TIMEOUT_S = 30.0


class TPLeaderLink:
    """Rank 0's end of the followers' KV pipes (used from the engine's step thread)."""

    def __init__(self, conns: list):
        self.conns = conns
        self._held: list[tuple] = []  # reports read while waiting for acks, for the next reports()

    def send(self, msg: tuple, ack: bool = False) -> None:
        """`ack`: return once every rank has carried the message out (new pins: their params are
        about to leave, and a reader may reach rank r at once)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self.conns:
            c.send_bytes(data)
        if ack:
            self._await_acks()

    def _await_acks(self) -> None:
        waiting = set(self.conns)
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while waiting and (left := deadline - time.monotonic()) > 0:
            for c in multiprocessing.connection.wait(list(waiting), left):
                try:
                    msg = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    waiting.discard(c)  # the rank died: the TP watchdog ends the worker
                    continue
                if msg[0] == "applied":
                    waiting.discard(c)
                else:
                    self._held.append(msg)
        if waiting:
            log.error("%d tensor-parallel rank(s) did not mirror new KV pins within %.0fs", len(waiting),
                      ACK_TIMEOUT_S)

    def reports(self) -> list[tuple]:
        out, self._held = self._held, []
        for c in self.conns:
            try:
                while c.poll():
                    out.append(pickle.loads(c.recv_bytes()))
            except (EOFError, OSError):
                pass  # the rank died: the TP watchdog ends the worker
        return out

    def wait(self, timeout: float) -> None:
        if not self._held:
            multiprocessing.connection.wait(self.conns, timeout)


class FollowerKV:
    """The KV side of tensor-parallel ranks, handed by the engine to executor/tp_ranks.py (which
    starts the ranks and knows nothing of KV): rank 0's link to the ranks' pipes, and each
    follower's connector. Passed as the class (pickled by reference into a rank's process)."""

    @staticmethod
    def leader(conns: list) -> "TPLeaderLink":
        return TPLeaderLink(conns)

    @staticmethod
    def start(conn, config: EngineConfig, runner, rank: int) -> None:
        start_follower_kv(conn, config, runner.kv_cache.tensor,
                          TPRank(rank, config.tensor_parallel_size, runner.model_config.num_kv_heads))


def start_follower_kv(conn, config: EngineConfig, cache, tp: TPRank) -> None:
    """Rank >= 1: serve rank 0's KV messages on a thread of their own."""
    threading.Thread(target=_follower_loop, args=(conn, config, cache, tp), name=f"tp-kv-rank{tp.rank}",
                     daemon=True).start()


def _follower_loop(conn, config: EngineConfig, cache, tp: TPRank) -> None:
    from pdserve.worker.kv.connector import KVConnector

    lock = threading.Lock()  # reports come from pull threads and the side-channel thread

    def report(msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(data)

    connector = None
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # rank 0 is gone; the step pipe's watch ends this process
        try:
            if msg[0] == "init":
                connector = KVConnector(config, cache, msg[1], msg[2], tp=tp, report=report)
                if config.role in ("prefill", "both"):
                    connector.start_server()
            elif msg[0] == "orders":
                connector.apply_follower(msg[1])
                if msg[1].pins:
                    report(("applied", tp.rank))  # rank 0 waits for it before the pins' params leave
        except BaseException:  # e.g. --kv-port + rank taken: the worker cannot serve P/D correctly
            log.exception("tensor-parallel rank %d: KV connector failed on %r; exiting", tp.rank, msg[0])
            for h in logging.getLogger().handlers:
                h.flush()
            os._exit(1)
