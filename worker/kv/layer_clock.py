"""How far a launched prefill step has written its KV, layer by layer.

A streamed hand-off over TCP sends each block once its KV is computed. Whole blocks are known
to be written only when their step is collected, so the last step's bytes (the chunk that ends
the prompt) would all be left for after the prefill: on a link about as fast as the prefill
makes KV, that is most of the first token's stall. The KV layout is block-major with the layers
inside a block ([block, layer, k|v, ...], kv_cache.py), so layer l of a run of blocks is a
strided but fixed slice: it can leave as soon as the forward has passed layer l, while later
layers are still being computed (as layer-wise KV connectors do).

The model's forward calls `after_layer(i)` once per decoder layer (the step thread, while it
launches the step). On a GPU that records a CUDA event on the compute stream: the senders' copy
of layer i's slice starts once the event has completed. On the CPU the forward runs as it is
called, so the mark is the fact itself, and waiting senders are woken.

One clock per launched step that computes a streamed prefill chunk; the pin table holds it
next to the blocks that step completes (`PinTable.computing`), until the step is collected.
With the TCP senders in their own process, a clock also takes a slot of a shared ring
(shared_clocks.py) and writes its count there, so they can read it.
"""

from __future__ import annotations

import threading
import time

import torch

# A running step's layers move in groups of at least 1/LAYER_GROUPS of them (or the rest): each
# piece (TCP) or READ (NIXL) costs Python time on the prefill side, where the step thread needs
# the GIL, and per-block descriptors on the reader's (a layer range of a block is one).
LAYER_GROUPS = 8


class LayerClock:
    def __init__(self, num_layers: int, device: torch.device, ring=None):
        self.num_layers = num_layers
        self._cuda = device.type == "cuda"
        # shared_clocks.ClockRing, or None (also for a clock of other layers than the ring's
        # cache: its blocks then count as written once the step is collected, in the senders' process).
        self._ring = ring if ring is not None and ring.num_layers == num_layers else None
        self._slot, self._gen = self._ring.claim() if self._ring is not None else (None, None)
        self._events: list = []  # CUDA: one per layer passed at launch, in order
        self._done = 0  # leading layers known written
        self._lock = threading.Lock()
        # (layers, woken) of each waiting thread: a mark wakes only those it brings to their layer.
        # A condition's notify_all per mark woke every sender at every layer (4 streams x 32 layers
        # a step), each wake a GIL take inside the launch the step thread is running. Fewer wakes
        # did not measurably move the TCP TTFT on an H200 (docs/tcp-kv-gpu-results.md).
        self._waiters: list[tuple[int, threading.Event]] = []

    def after_layer(self, i: int) -> None:
        """The forward has queued (GPU) or run (CPU) decoder layer `i`, KV write included."""
        if self._cuda:
            # Blocking: a waiting sender sleeps rather than spins a core.
            event = torch.cuda.Event(blocking=True) if self._ring is None else self._ring.event(self._slot, i)
            event.record()
        with self._lock:
            if self._cuda:
                self._events.append(event)
                passed = len(self._events)
            else:
                self._done = passed = max(self._done, i + 1)
            if self._ring is not None:
                self._ring.mark(self._slot, passed)
            if not self._waiters:
                return
            due = [w for w in self._waiters if w[0] <= passed]
            self._waiters = [w for w in self._waiters if w[0] > passed]
        for _, woken in due:
            woken.set()

    @property
    def shared(self) -> tuple[int, int, int] | None:
        """(ring slot, generation, layers): how another process names this clock (None: no ring)."""
        return None if self._ring is None else (self._slot, self._gen, self.num_layers)

    def done(self) -> int:
        """How many leading layers are written now (never blocks: CUDA event queries)."""
        with self._lock:
            while self._cuda and self._done < len(self._events) and self._events[self._done].query():
                self._done += 1
            return self._done

    def wait(self, n: int, timeout_s: float) -> bool:
        """Wait until the first `n` layers are written (True), at most about `timeout_s` for the
        forward to reach them (a launched layer's event is then waited for without a bound: the
        device completes what it was given)."""
        with self._lock:
            passed = len(self._events) if self._cuda else self._done
            woken = None
            if passed < n:
                woken = threading.Event()
                self._waiters.append((n, woken))
        if woken is not None and not woken.wait(timeout_s):
            with self._lock:
                if (n, woken) in self._waiters:  # not reached: no longer waiting (else a mark just took it)
                    self._waiters.remove((n, woken))
                    return False
        if not self._cuda:
            return True
        with self._lock:
            event = self._events[n - 1]
        event.synchronize()  # releases the GIL
        with self._lock:
            self._done = max(self._done, n)
        return True


class ClockWatch:
    """Wakes the side channel when a launched step's forward passes a layer someone waits for.

    The side channel retries its deferred requests when a pin changes (`PinTable` calls its
    `wake`); a layered reader's progress waits for the next layer of a step that is running,
    which changes no pin. One thread sleeps on that layer's clock (a blocking CUDA event: no
    spinning core, no GIL held) and wakes the channel, whose retry answers with every layer
    written by then. A wait the forward never reaches (its step ended otherwise) is given up
    after `give_up_s`: the deferred request is answered at its deadline or by the pin's next change.
    """

    POLL_S = 0.05  # one clock's wait at a time: look at the others this often

    def __init__(self, wake, give_up_s: float = 1.0):
        self._wake = wake
        self.give_up_s = give_up_s
        self._want: dict[LayerClock, tuple[int, float]] = {}  # clock -> (layer to pass, since)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, clock: LayerClock, layer: int) -> None:
        """Any thread: wake the channel once `clock` has passed `layer` layers."""
        now = time.monotonic()
        with self._cond:
            if self._stopped:
                return
            have = self._want.get(clock)
            self._want[clock] = (min(layer, have[0]), have[1]) if have else (layer, now)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-clock-watch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._want and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                clock, (layer, _) = next(iter(self._want.items()))  # the oldest first
            passed = clock.wait(layer, self.POLL_S)
            with self._cond:
                want = self._want.pop(clock, None)
                if want is not None and not (passed and want[0] <= layer) \
                        and time.monotonic() - want[1] <= self.give_up_s:
                    self._want[clock] = want  # not there yet: behind the others
            if passed:
                self._wake()
