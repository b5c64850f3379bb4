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
"""

from __future__ import annotations

import threading

import torch


class LayerClock:
    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self._cuda = device.type == "cuda"
        self._events: list = []  # CUDA: one per layer passed at launch, in order
        self._done = 0  # leading layers known written
        self._cond = threading.Condition()

    def after_layer(self, i: int) -> None:
        """The forward has queued (GPU) or run (CPU) decoder layer `i`, KV write included."""
        if self._cuda:
            event = torch.cuda.Event(blocking=True)  # a waiting sender sleeps rather than spins a core
            event.record()
            with self._cond:
                self._events.append(event)
                self._cond.notify_all()
            return
        with self._cond:
            self._done = max(self._done, i + 1)
            self._cond.notify_all()

    def done(self) -> int:
        """How many leading layers are written now (never blocks: CUDA event queries)."""
        with self._cond:
            while self._cuda and self._done < len(self._events) and self._events[self._done].query():
                self._done += 1
            return self._done

    def wait(self, n: int, timeout_s: float) -> bool:
        """Wait until the first `n` layers are written (True), at most about `timeout_s` for the
        forward to reach them (a launched layer's event is then waited for without a bound: the
        device completes what it was given)."""
        with self._cond:
            if not self._cond.wait_for(lambda: (len(self._events) if self._cuda else self._done) >= n, timeout_s):
                return False
            if not self._cuda:
                return True
            event = self._events[n - 1]
        event.synchronize()  # releases the GIL
        with self._cond:
            self._done = max(self._done, n)
        return True
