"""The processes of a tensor-parallel worker: rank 0 leads, ranks 1..N-1 follow its step plan.

Rank 0 is the serving process: HTTP, scheduler, sampling. At start the engine spawns one process
per other rank (`start_followers`); each builds its own ModelRunner shard (the engine passes the
runner class in, so this module never imports the runner and the runner never imports this
module: the runner only calls `send`) and then loops: receive a
`StepPlan` (token ids, positions, KV slots, block tables, which rows to project to logits), run
the same forward as rank 0, take part in the collectives, repeat. Plans travel over one pipe
per follower, pickled once per step: a few KB, tens of microseconds, and no collective that
would have to wait (and time out) while the server is idle.

Failure: each side watches the other. Rank 0 waits on the followers' process sentinels; a
follower that exits while the worker is not shutting down is logged by rank and exit code and
the whole worker exits (code 1) at once, whatever collective rank 0 is blocked in. A follower
polls for its parent and exits when rank 0 is gone (or its pipe closes), so no rank outlives
the worker.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time

from pdserve.worker.config.engine import ConfigError, EngineConfig
from pdserve.worker.parallel.group import create_store, shutdown_tensor_parallel

log = logging.getLogger(__name__)

PARENT_POLL_S = 1.0
SHUTDOWN_WAIT_S = 10.0
EXIT_CODE_RANK_DIED = 1


def _flush_logs() -> None:
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stderr.flush()


class TPFollowers:
    """Rank 0's handle on ranks 1..N-1: start them, send each step's plan, stop or watch them."""

    def __init__(self, config: EngineConfig, build_runner, store_port: int, attention_backend: str | None,
                 static_decode: bool | None, kv=None):
        """`build_runner(config, attention_backend=, static_decode=, tp_rank=, tp_store_port=)`
        makes a rank's runner in its process (ModelRunner; pickled by reference). `kv`: a P/D
        worker's KV side of the ranks (kv/tp_link.FollowerKV: `leader(pipes)`, `start(pipe,
        config, runner, rank)`), or None."""
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self._procs: list[mp.Process] = []
        self._conns = []
        kv_conns = []
        self._stopping = False
        for rank in range(1, config.tensor_parallel_size):
            recv, send = ctx.Pipe(duplex=False)
            # P/D: the KV connector's messages both ways (kv/tp_link.py), apart from the step plans.
            kv_ours, kv_theirs = ctx.Pipe(duplex=True) if kv is not None else (None, None)
            p = ctx.Process(target=follower_main, name=f"pdserve-tp-rank{rank}", daemon=True,
                            args=(config, build_runner, rank, store_port, recv, attention_backend, static_decode,
                                  os.getpid(), kv_theirs, kv))
            p.start()
            recv.close()  # the follower's end; ours would keep the pipe open after it dies
            if kv_theirs is not None:
                kv_theirs.close()
                kv_conns.append(kv_ours)
            self._procs.append(p)
            self._conns.append(send)
        self.kv_link = kv.leader(kv_conns) if kv_conns else None
        log.info("tensor parallel: started ranks 1..%d (pids %s)", len(self._procs),
                 ", ".join(str(p.pid) for p in self._procs))
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def send(self, plan) -> None:
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self._conns:
            c.send_bytes(data)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        ready = mp.connection.wait(list(sentinels))
        if self._stopping:
            return
        rank, p = sentinels[ready[0]]
        p.join(0.1)
        log.critical("tensor-parallel rank %d (pid %d) exited with code %s; the worker cannot continue without it "
                     "and exits now", rank, p.pid, p.exitcode)
        self._terminate()
        _flush_logs()
        os._exit(EXIT_CODE_RANK_DIED)

    def _terminate(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for c in self._conns:
            try:
                c.send_bytes(pickle.dumps(None))
                c.close()
            except OSError:
                pass  # already gone
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._terminate()


def _watch_parent(parent_pid: int, rank: int) -> None:
    def loop():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log.critical("tensor-parallel rank %d: rank 0 (pid %d) is gone; exiting", rank, parent_pid)
        _flush_logs()
        os._exit(EXIT_CODE_RANK_DIED)

    threading.Thread(target=loop, name="tp-parent-watch", daemon=True).start()


def start_followers(config: EngineConfig, build_runner, attention_backend: str | None = None,
                    static_decode: bool | None = None, kv=None):
    """Rank 0, before its own runner: check that the model shards (a ConfigError now, before any
    process starts), create the rendezvous store, start ranks 1..N-1. -> (store, TPFollowers)."""
    from pdserve.worker.models.loader import read_model_config, resolve_model_path
    from pdserve.worker.parallel.shard import TPShard

    cfg = read_model_config(resolve_model_path(config.model, weights=config.load_format != "dummy"))
    TPShard(0, config.tensor_parallel_size, cfg, expert_parallel=config.enable_expert_parallel and cfg.is_moe)
    store = create_store(config.tensor_parallel_size)
    return store, TPFollowers(config, build_runner, store.port, attention_backend, static_decode, kv)


def follower_main(config: EngineConfig, build_runner, rank: int, store_port: int, conn,
                  attention_backend: str | None, static_decode: bool | None, parent_pid: int,
                  kv_conn=None, kv=None) -> None:
    """Entry point of rank >= 1: build the shard, then run every plan rank 0 sends until told to stop."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    _watch_parent(parent_pid, rank)
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr (C-level handler: works
    # while the rank is blocked in a CUDA/NCCL call); bench/tp.py --timeout sends it to all ranks.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        runner = build_runner(config, attention_backend=attention_backend, static_decode=static_decode,
                              tp_rank=rank, tp_store_port=store_port)
        if kv_conn is not None:  # P/D: this rank's KV connector, driven by rank 0 (kv/tp_link.py)
            kv.start(kv_conn, config, runner, rank)
        log.info("tensor-parallel rank %d ready: waiting for step plans", rank)
        steps = 0
        previous = None  # async scheduling: the last step's sampled ids, broadcast by rank 0
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:  # rank 0 says None before it closes the pipe: without that, it died
                log.critical("tensor-parallel rank %d: rank 0 (pid %d) is gone (its step pipe closed); exiting",
                             rank, parent_pid)
                _flush_logs()
                os._exit(EXIT_CODE_RANK_DIED)
            plan = pickle.loads(data)
            if plan is None:
                break
            if steps == 0:
                log.info("tensor-parallel rank %d: first step plan received (%s)", rank,
                         "graph" if plan.graph else "eager")
            if plan.inputs is None:  # the host tier's copies alone, between steps: `previous` still holds
                runner.execute(plan)
                continue
            runner.execute(plan, previous)
            previous = runner.receive_sampled(plan.share_tokens) if plan.share_tokens else None
            if steps == 0:
                log.info("tensor-parallel rank %d: first step issued (its GPU work queued)", rank)
            steps += 1
    except ConfigError as e:  # rank 0 meets the same limit; say it once, without a traceback
        log.critical("tensor-parallel rank %d: %s", rank, e)
        _flush_logs()
        os._exit(EXIT_CODE_RANK_DIED)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        _flush_logs()
        os._exit(EXIT_CODE_RANK_DIED)
    shutdown_tensor_parallel()
