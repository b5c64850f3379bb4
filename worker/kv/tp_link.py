"""The KV connector across the ranks of one tensor-parallel worker: rank 0 decides, every rank moves bytes.

The scheduler half lives on rank 0 only (it owns requests and blocks); the worker half
(connector.KVConnector) runs on every rank over that rank's cache shard. They talk over one
duplex pipe per follower (made by parallel/ranks.TPFollowers beside its step pipe), read on the
follower by a thread of its own, so a pin is mirrored at once even while the rank runs a step.

rank 0 -> rank r
  ("init", engine_id, layout)                   build rank r's connector (and, on a prefill
                                                worker, its side channel on --kv-port + r)
  ("pin", rid, block_ids, token, prompt_digest) mirror the pin rank 0 just made, before its
                                                kv_transfer_params leave the worker
  ("release", rid, token)                       rank 0 released its pin itself: release the mirror
  ("pin_streamed", rid, block_ids, token,       a streamed prefill's pin, made at admission with
   prompt_digest, ready)                        `ready` blocks computed
  ("advance", rid, ready)                       a step ended: `ready` blocks are computed on every
                                                rank (rank 0 waited for its device, and the step's
                                                collectives tie every rank's KV writes before it)
  ("finish", rid, first_token_id)               the streamed prefill ended
  ("cancel", rid)                               it will not (aborted, or its first token ended it)
  ("loads", [KVLoad, ...])                      this step's pulls: rank r reads its own heads
  ("cancels", [rid, ...])                       requests aborted mid-pull: stop their streamed pulls
rank r -> rank 0
  ("pulled", r, rid, error or None)             rank r's pull of rid landed (or failed)
  ("unpinned", r, rid)                          rank r's pin of rid was released or expired

Rank 0 reports a pull to the scheduler only when every rank has (failed if any rank failed,
so all ranks fall back to local prefill together), and frees a pinned request's blocks only
when every rank's pin is gone (a decode rank may still be reading rank r's shard).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import threading

from pdserve.worker.config import EngineConfig
from pdserve.worker.kv.tp_transfer import TPRank

log = logging.getLogger(__name__)


def needs_kv_connector(config: EngineConfig) -> bool:
    """The same rule as the engine's: a plain worker (role both, no --kv-transfer) moves no KV."""
    return config.role != "both" or config.kv_transfer is not None


class TPLeaderLink:
    """Rank 0's end of the followers' KV pipes (used from the engine's step thread)."""

    def __init__(self, conns: list):
        self.conns = conns

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self.conns:
            c.send_bytes(data)

    def reports(self) -> list[tuple]:
        out = []
        for c in self.conns:
            try:
                while c.poll():
                    out.append(pickle.loads(c.recv_bytes()))
            except (EOFError, OSError):
                pass  # the rank died: the TP watchdog ends the worker
        return out

    def wait(self, timeout: float) -> None:
        multiprocessing.connection.wait(self.conns, timeout)


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
            elif msg[0] == "pin":
                _, rid, block_ids, token, digest = msg
                connector.pins.add(rid, block_ids, digest, token=token)
            elif msg[0] == "release":  # rank 0's own release (KVConnector.unpin); reported as "unpinned"
                connector.pins.release(msg[1], msg[2])
            elif msg[0] == "pin_streamed":
                _, rid, block_ids, token, digest, ready = msg
                connector.pins.add_streamed(rid, block_ids, digest, ready, token=token)
            elif msg[0] == "advance":
                connector.pins.advance(msg[1], msg[2])
            elif msg[0] == "finish":
                connector.pins.finish(msg[1], msg[2])
            elif msg[0] == "cancel":
                connector.pins.cancel(msg[1])
            elif msg[0] == "loads":
                connector.start_follower_loads(msg[1])
            elif msg[0] == "cancels":
                connector.stop_pulls(msg[1])
        except BaseException:  # e.g. --kv-port + rank taken: the worker cannot serve P/D correctly
            log.exception("tensor-parallel rank %d: KV connector failed on %r; exiting", tp.rank, msg[0])
            for h in logging.getLogger().handlers:
                h.flush()
            os._exit(1)
