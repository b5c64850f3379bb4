"""A helper process of the KV transport, and the engine's end of its pipe.

The TCP transport's data connections can run in processes of their own (`--kv-tcp-io process`:
tcp_sender_process.py on the prefill side, tcp_receiver_process.py on the decode side), so
that their Python never takes the GIL the engine's step thread needs. Both talk to the engine
the same way, here:

- `ChildLink` (engine side) spawns `target(conn, *args)` and reads the pipe on one thread.
  A request is `(op, n, ...)`; the child answers `("answer", n, kind, value)`, which resolves
  request n's future with `(kind, value)`. `("ready", value)` says the child serves (a caller
  waits for it, bounded), `("failed", text)` that it could not start; any other message goes to
  `on_message`. Sends are serialized by `lock`, which a caller may hold to send a request
  together with other state (the senders' process: a pin's snapshot in the order taken).
- When the pipe closes (the child exited, was killed, or was stopped) every pending request
  answers `("gone", text)` and `on_gone(stopping)` runs once; the owner then serves in-process.
- `ChildEnd` (child side): the loop over the engine's requests, a thread-safe `send`, and the
  set-up every such child does (Ctrl-C is the engine's to handle; one torch thread). A child
  exits when its pipe closes: it never outlives the engine.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures import Future

import torch
import torch.multiprocessing  # noqa: F401  registers the tensor reductions: shared storage, CUDA IPC

log = logging.getLogger(__name__)

START_S = 120.0  # the child imports torch (and on CUDA makes a context) before it serves
ANSWER_S = 10.0  # what a child answers from memory


class ChildGone(RuntimeError):
    """The helper process is not running (it died, was stopped, or never started)."""


class ChildLink:
    def __init__(self, name: str, target, args: tuple, on_message=None, on_answer=None, on_gone=None):
        """`on_answer(tag, kind)`: under `lock`, as request `tag`'s answer arrives (before its
        future resolves); `on_gone(stopping)`: once, after every pending request answered "gone"."""
        self.name = name
        self._on_message, self._on_answer, self._on_gone = on_message, on_answer, on_gone
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=target, args=(child_conn, *args), name=name, daemon=True)
        self._started_at = time.monotonic()
        self._proc.start()
        child_conn.close()
        self.lock = threading.Lock()  # the pipe's sends, and what an owner sends with them
        self._answers: dict[int, tuple[Future, object]] = {}
        self._ids = itertools.count()
        self._ready = threading.Event()
        self.ready_value = None
        self.gone = self._stopping = False
        self._reader = threading.Thread(target=self._events, name=f"{name}-events", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def wait_ready(self, timeout_s: float = START_S) -> None:
        if not self._ready.wait(timeout_s) or self.gone:
            raise ChildGone(f"the {self.name} process is not running")

    def register(self, tag=None) -> tuple[int, Future]:
        """Under `lock`: a request's number and the future its answer resolves."""
        if self.gone:
            raise ChildGone(f"the {self.name} process is not running")
        n, answer = next(self._ids), Future()
        self._answers[n] = (answer, tag)
        return n, answer

    def send_locked(self, msg: tuple) -> None:
        """Under `lock`. ChildGone when the pipe is closed (the child died a moment ago)."""
        try:
            self._conn.send(msg)
        except OSError as e:
            raise ChildGone(f"the {self.name} process is gone ({e})") from None

    def send(self, msg: tuple) -> None:
        """A message without an answer; dropped if the child is gone (its pipe's end says so)."""
        with self.lock:
            if not self.gone:
                try:
                    self.send_locked(msg)
                except ChildGone:
                    pass

    def call(self, op: str, *args, wait_s: float = ANSWER_S):
        """A request the child answers from memory: its value. ChildGone if it is not running."""
        self.wait_ready()
        with self.lock:
            n, answer = self.register()
            self.send_locked((op, n, *args))
        kind, value = self.result(answer, wait_s)
        if kind == "gone":
            raise ChildGone(value)
        return value

    def result(self, answer: Future, wait_s: float | None) -> tuple[str, object]:
        """(kind, value) of a request; a child that does not answer within `wait_s` is killed."""
        try:
            return answer.result(wait_s)
        except TimeoutError:
            log.error("the %s process did not answer in %.0f s: stopping it", self.name, wait_s)
            self._proc.kill()  # its pipe closes: every pending request answers "gone"
            raise ChildGone(f"the {self.name} process did not answer") from None

    def close(self) -> None:
        self._stopping = True
        self.send(("stop",))
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)
        self._conn.close()

    def _events(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "answer":
                with self.lock:
                    answer, tag = self._answers.pop(msg[1], (None, None))
                    if self._on_answer is not None and tag is not None:
                        self._on_answer(tag, msg[2])
                if answer is not None:
                    answer.set_result((msg[2], msg[3]))
            elif kind == "ready":
                self.ready_value = msg[1]
                log.info("%s: pid %d, up in %.1f s%s", self.name, self._proc.pid, time.monotonic() - self._started_at,
                         "" if msg[1] is None else f", serving {msg[1]}")
                self._ready.set()
            elif kind == "failed":
                log.error("the %s process could not start: %s", self.name, msg[1])
                break
            elif self._on_message is not None:
                self._on_message(msg)
        with self.lock:
            self.gone = True
            answers, self._answers = self._answers, {}
        self._ready.set()
        for answer, _ in answers.values():
            answer.set_result(("gone", f"the {self.name} process is gone"))
        if not self._stopping:
            log.error("the %s process (pid %s) exited (code %s); its work is served in the engine's process from "
                      "now on", self.name, self._proc.pid, self._proc.exitcode)
        if self._on_gone is not None:
            self._on_gone(self._stopping)


class ChildEnd:
    """The child's end of the pipe."""

    def __init__(self, conn, log_level: int, what: str):
        # Ctrl-C reaches the whole process group: the engine stops this child (its pipe closes),
        # so the child does not die first and look like a crash to it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s {what} %(name)s: %(message)s")
        torch.set_num_threads(1)  # its copies are memcpy-sized; the engine owns the cores
        self._conn, self._lock = conn, threading.Lock()

    def send(self, *msg) -> None:
        with self._lock:
            try:
                self._conn.send(msg)
            except OSError:
                pass  # the engine is gone; `serve` ends on its EOF

    def serve(self, handle, on_exit) -> None:
        """`handle(msg)` each request until "stop" or the engine's end closes; then `on_exit()`
        and the process ends (threads still sending are daemons: the engine has stopped waiting)."""
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "stop":
                    break
                handle(msg)
        finally:
            on_exit()
            os._exit(0)
