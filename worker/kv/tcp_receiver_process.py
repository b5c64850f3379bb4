"""The TCP transport's receivers in a process of their own (`--kv-tcp-io process`, decode side).

A decode worker's pull lands its bytes through tcp_stream.receive: a thread per data stream that
receives a piece into a page-locked buffer and copies it into the cache, a few GIL takes a
piece, inside the decode steps the engine runs meanwhile for other requests. Here those threads
run in a child process that maps the engine's KV cache (CUDA IPC; on CPU the cache in shared
memory, as the senders' process does: tcp_sender_process.py), and the engine's pull thread
only asks and waits:

- the side channel's `read` (authorization, the grant) stays in the engine (tcp_transport.tcp_pull);
  the grant's data streams are received by the child: one request (ticket, plan, the
  destination blocks, the deadline and stall bounds), one answer (the bytes, or why not). The
  child has synchronized its copies before it answers: the blocks are written when the engine
  hears so, as when tcp_stream.receive returns.
- a cancel (the request was aborted mid-read) is one message; the child stops the read's streams
  and answers as tcp_stream.receive would.
- a child that dies fails the reads it had (their requests prefill locally, as for any failed
  pull); later pulls are received by threads in the engine (logged).
- staged pulls (a peer of another tensor-parallel size lands in a staging buffer first) and
  tensor-parallel follower ranks keep in-process receivers.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from pdserve.worker.kv import side_channel, tcp_stream
from pdserve.worker.kv.child_link import ANSWER_S, ChildEnd, ChildGone, ChildLink
from pdserve.worker.kv.tcp_sender_process import tunables

TUNABLES = ("MAX_RECV_BYTES",)


class ReceiverProcess:
    def __init__(self, blocks: torch.Tensor, auth):
        self.blocks = blocks  # the cache this process's reads land in (not a staging buffer)
        if blocks.device.type == "cpu" and not blocks.is_shared():
            blocks.share_memory_()
        level = logging.getLogger("pdserve").getEffectiveLevel()
        self._link = ChildLink("pdserve-kv-tcp-receivers", child_main, (blocks, auth, tunables(TUNABLES), level))

    @property
    def gone(self) -> bool:
        return self._link.gone

    @property
    def pid(self) -> int | None:
        return self._link.pid

    def receive(self, host: str, port: int, ticket: bytes, plan: tcp_stream.Plan, dst_blocks: list[int],
                deadline: float, stall_s: float | None = None, cancel: tcp_stream.Cancel | None = None,
                framed: bool = False, layers: int = 0) -> int:
        """tcp_stream.receive into this process's cache, run by the child. ChildGone before
        anything was asked (the caller receives in-process); a child that dies mid-read fails it."""
        self._link.wait_ready()
        with self._link.lock:
            n, answer = self._link.register()
            self._link.send_locked(("receive", n, host, port, ticket, plan, list(dst_blocks), deadline, stall_s,
                                    framed, layers))
        if cancel is not None:
            cancel.on_cancel(lambda: self._link.send(("cancel", n)))
        # The child bounds a read by its deadline (a stream read: by its stall bound per piece,
        # however long the prefill takes); past that it must have answered.
        wait_s = None if stall_s is not None else max(0.0, deadline - time.monotonic()) + ANSWER_S
        try:
            kind, value = self._link.result(answer, wait_s)
        except ChildGone as e:
            raise side_channel.SideChannelError(f"KV peer {host}:{port}: {e}") from None
        if kind == "ok":
            return value
        if kind == "timeout":
            raise side_channel.PeerTimeout(value)
        raise side_channel.SideChannelError(value if kind != "gone" else f"KV peer {host}:{port}: {value}")

    def close(self) -> None:
        self._link.close()


def child_main(conn, blocks: torch.Tensor, auth, settings: tuple, log_level: int) -> None:
    end = ChildEnd(conn, log_level, "kv-tcp-receivers")
    for name, value in settings:
        setattr(tcp_stream, name, value)
    cancels: dict[int, tcp_stream.Cancel] = {}
    lock = threading.Lock()

    def run(n: int, args: tuple, cancel: tcp_stream.Cancel) -> None:
        host, port, ticket, plan, dst_blocks, deadline, stall_s, framed, layers = args
        try:
            got = tcp_stream.receive(host, port, ticket, plan, dst_blocks, blocks, deadline, auth, stall_s, cancel,
                                     framed, layers)
            end.send("answer", n, "ok", got)
        except side_channel.PeerTimeout as e:
            end.send("answer", n, "timeout", str(e))
        except Exception as e:  # noqa: BLE001  the read failed: said to the engine's pull, which falls back
            end.send("answer", n, "failed", str(e) if isinstance(e, side_channel.SideChannelError)
                     else f"{type(e).__name__}: {e}")
        finally:
            with lock:
                cancels.pop(n, None)

    def handle(msg) -> None:
        if msg[0] == "receive":
            cancel = tcp_stream.Cancel()
            with lock:
                cancels[msg[1]] = cancel  # before a "cancel" for it can be read
            threading.Thread(target=run, args=(msg[1], msg[2:], cancel), name="kv-tcp-receive", daemon=True).start()
        elif msg[0] == "cancel":
            with lock:
                cancel = cancels.get(msg[1])
            if cancel is not None:
                cancel.cancel()

    end.send("ready", None)
    end.serve(handle, lambda: None)
