"""Blocks a prefill worker holds for a remote decode worker, until released or expired.

Shared between the engine's step thread (adds, frees) and the side-channel and TCP sender
threads (reads, releases), hence the lock. A pin with a read in progress is never freed, by
TTL or by a release: its blocks could be reallocated while their bytes are on the wire. A read
this worker serves itself (TCP) holds the pin from `open_read` to `close_read`, exactly as long
as it runs; a remote read (NIXL: the reader moves the bytes, and only its release says it is
over) holds a lease for LEASE_S, so a reader that dies mid-read costs that long.

A pin is bound to the digest of the prompt its blocks were computed from: a reader must
present the digest of *its* prompt, so valid params replayed with another prompt of the same
length get nothing (the decode side would otherwise cache A's KV under B's block hashes).

A streamed pin (the streamed hand-off) is made when its prefill is admitted, before any block
is computed: `ready` counts its leading blocks whose KV is written, and grows after each
prefill step (`advance`); `finish` records the first token and makes every block readable;
`cancel` ends it (the prefill was aborted or its first token ended the request). A reader
asking for blocks not ready yet, or for progress with nothing new, gets `NotReady` and the
side channel answers later (a deferred reply). A running pin never expires: its request is
alive on this worker, and its end (finish or cancel) starts the TTL. A streamed TCP read is
opened once, before its blocks are computed (`open_read(..., streamed=True)`), and its sender
threads wait for each chunk (`wait_ready`), so the bytes follow the prefill without a round trip
per chunk. A launched step that computes a chunk is announced too (`computing`: the blocks it
completes and its layer_clock.LayerClock), so a layered read can send those blocks, or their
first layers, while the step runs (`readiness`); the step's collection (`advance`) makes them
ready for every reader.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.worker.kv.layer_clock import LAYER_GROUPS
from pdserve.worker.kv.prompt_binding import bind_token


# How long a remote (NIXL) reader may hold a pin past its TTL while its bytes are on the wire.
LEASE_S = 60.0
HANG_UP_POLL_S = 0.25  # how often a waiting streamed read looks whether its reader left


RUNNING, DONE, CANCELLED = "running", "done", "cancelled"


@dataclass
class Pin:
    block_ids: list[int]
    token: str
    prompt_digest: str  # prompt_binding.prompt_digest of the prompt these blocks hold
    expires_at: float  # monotonic
    leased_until: float = 0.0
    readers: int = 0  # reads this worker is serving now (open_read .. close_read)
    released: bool = False
    ready: int = 0  # leading blocks whose KV is computed (all of them once DONE)
    state: str = DONE
    first_token_id: int | None = None  # known once DONE (streamed pins)
    last: bool = False  # the prefill step now running computes the rest (streamed pins)
    # Streamed pins: (blocks ready once it ends, its clock) of each launched step not yet
    # collected that computes this prompt, in launch order (`computing`).
    computing: list = dataclasses.field(default_factory=list)

    def progress(self) -> dict:
        """What a streamed pin's reader is told (`PinTable.progress`, `PinTable.state`)."""
        return {"ready": self.ready, "state": self.state, "first_token_id": self.first_token_id, "last": self.last}


class PinError(PermissionError):
    pass


@dataclass(frozen=True)
class PinSnapshot:
    """A pin as another process sees it (the TCP senders' own: tcp_sender_process.py).
    `computing`: (upto, clock slot, clock generation, layers) of each launched step whose clock
    is in a shared ring (shared_clocks.py)."""

    token: str
    prompt_digest: str
    state: str
    ready: int
    total: int
    computing: tuple[tuple[int, int, int, int], ...]
    released: bool
    expires_at: float  # monotonic (the clock is the host's, the same in every process)

    def check(self, token, prompt_digest, now: float) -> None:
        """PinError unless a reader holding `token` and `prompt_digest` may still read it."""
        if not (isinstance(token, str) and isinstance(prompt_digest, str)):
            raise PinError("unknown, released or expired transfer, or a wrong transfer token")
        check_reader(self, token, prompt_digest, now)


def check_reader(pin, token: str, prompt_digest: str, now: float, cancelled_ok: bool = False) -> None:
    """PinError unless the holder of `token` and `prompt_digest` may read `pin` (a Pin or a
    PinSnapshot) at `now`; `cancelled_ok`: a cancelled pin passes (its reader is told so)."""
    if not secrets.compare_digest(pin.token.encode(), token.encode()):
        raise PinError("unknown, released or expired transfer, or a wrong transfer token")
    if pin.state == CANCELLED:
        if cancelled_ok and secrets.compare_digest(pin.prompt_digest.encode(), prompt_digest.encode()):
            return
        raise PinError("the prefill was cancelled: its KV will not be computed")
    if pin.released:
        raise PinError("unknown, released or expired transfer, or a wrong transfer token")
    if pin.expires_at <= now:
        raise PinError("the transfer token has expired")
    if not secrets.compare_digest(pin.prompt_digest.encode(), prompt_digest.encode()):
        raise PinError("prompt mismatch: these KV blocks were computed from a different prompt")


def wait_ready(changes: threading.Condition, readable: Callable[[], object], upto: int, timeout_s: float,
               hung_up: Callable[[], bool] | None = None, computing_ok: bool = False) -> bool:
    """`PinTable.wait_ready`'s loop over any pin source: `readable()` (under `changes`' lock)
    returns the pin or raises PinError; `changes` is notified when it may have changed."""
    deadline = time.monotonic() + timeout_s
    while True:
        with changes:
            pin = readable()
            computing = computing_ok and any(u >= upto for u, *_ in pin.computing)
            if pin.state != RUNNING or pin.ready >= upto or computing:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            changes.wait(min(left, HANG_UP_POLL_S))
        if hung_up is not None and hung_up():
            raise ConnectionError("the reader hung up")


class NotReady(Exception):
    """Nothing to answer yet: the side channel replies when the pin changes (or at its deadline).
    `clock`, `layer`: what would change the answer without changing the pin, a launched step's
    forward passing that layer (a layered reader's progress; see ClockWatch)."""

    def __init__(self, clock=None, layer: int = 0):
        super().__init__()
        self.clock, self.layer = clock, layer


class PinTable:
    def __init__(self, ttl: float):
        self.ttl = ttl
        self._pins: dict[str, Pin] = {}
        # Cancelled pins already freed, for a TTL: a reader whose read broke off learns from
        # `progress` that the prefill was cancelled (its request ends), not that the pin expired
        # (it would prefill locally and answer a request the prefill side has ended).
        self._cancelled: dict[str, Pin] = {}
        self._lock = threading.Lock()
        self._changes = threading.Condition(self._lock)  # wait_ready's waiters
        self.on_change = None  # () -> None: a streamed pin changed (the side channel retries its waiters)
        self.observer = None  # (request id) -> None: that pin changed (the TCP senders' process mirrors it)

    def add(self, request_id: str, block_ids: list[int], prompt_digest: str,
            token: str | None = None) -> tuple[str, float]:
        """Pin blocks; returns (transfer token, wall-clock expiry) for kv_transfer_params.
        `token`: a tensor-parallel rank >= 1 mirrors rank 0's pin under rank 0's token."""
        token = token or bind_token(secrets.token_urlsafe(24), prompt_digest)
        with self._lock:
            self._pins[request_id] = Pin(list(block_ids), token, prompt_digest, time.monotonic() + self.ttl)
        return token, time.time() + self.ttl

    def add_streamed(self, request_id: str, block_ids: list[int], prompt_digest: str, ready: int,
                     token: str | None = None) -> str:
        """Pin a prefill's blocks at admission: `ready` of them hold KV already (prefix-cache hits)."""
        token = token or bind_token(secrets.token_urlsafe(24), prompt_digest)
        with self._lock:
            self._pins[request_id] = Pin(list(block_ids), token, prompt_digest, float("inf"), ready=ready,
                                         state=RUNNING)
        return token

    def advance(self, request_id: str, ready: int) -> None:
        """Step thread: the prefill step that just ended made `ready` leading blocks readable."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.state != RUNNING or ready <= pin.ready:
                return
            pin.ready = min(ready, len(pin.block_ids))
            pin.computing = [(upto, clock) for upto, clock in pin.computing if upto > pin.ready]
        self._changed(request_id)

    def computing(self, request_id: str, upto: int, clock) -> None:
        """Step thread, before a step is launched: it completes the pin's blocks up to `upto`,
        layer by layer as `clock` (a layer_clock.LayerClock) tells."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.state != RUNNING or upto <= pin.ready:
                return
            pin.computing.append((min(upto, len(pin.block_ids)), clock))
        self._changed(request_id)

    def last_step(self, request_id: str) -> None:
        """Step thread: the prefill's step now running (or next) computes the rest of the prompt."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.state != RUNNING or pin.last:
                return
            pin.last = True
        self._changed(request_id)

    def finish(self, request_id: str, first_token_id: int) -> tuple[str, float] | None:
        """The prefill ended on its first token: every block is readable, the TTL starts.
        Returns (token, wall-clock expiry), or None when the pin is gone (released meanwhile)."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.released:
                return None
            pin.state, pin.ready, pin.first_token_id = DONE, len(pin.block_ids), first_token_id
            pin.computing = []
            pin.expires_at = time.monotonic() + self.ttl
            token = pin.token
        self._changed(request_id)
        return token, time.time() + self.ttl

    def cancel(self, request_id: str) -> bool:
        """The prefill will not finish for a reader (aborted, or its first token ended the
        request): readers are told, and the blocks are freed once no read holds them."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None:
                return False
            pin.state, pin.released, pin.computing = CANCELLED, True, []
        self._changed(request_id)
        return True

    def _changed(self, request_id: str) -> None:
        with self._lock:
            self._changes.notify_all()
        if self.observer is not None:
            self.observer(request_id)
        if self.on_change is not None:
            self.on_change()

    def _authenticate(self, request_id, token, prompt_digest, now: float, cancelled_ok: bool = False) -> Pin:
        if not (isinstance(request_id, str) and isinstance(token, str) and isinstance(prompt_digest, str)):
            raise PinError("request_id, token and prompt_digest must be strings")
        pin = self._pins.get(request_id)
        if pin is None and cancelled_ok:
            pin = self._cancelled.get(request_id)
        if pin is None:
            raise PinError("unknown, released or expired transfer, or a wrong transfer token")
        check_reader(pin, token, prompt_digest, now, cancelled_ok)
        return pin

    def _readable(self, request_id, token, prompt_digest, now: float, indices) -> Pin:
        """Under the lock: the reader's pin, NotReady while any of `indices` is not computed yet."""
        pin = self._authenticate(request_id, token, prompt_digest, now)
        if indices and pin.state == RUNNING and any(type(i) is int and i >= pin.ready for i in indices):
            raise NotReady()
        return pin

    def lease(self, request_id: str, token: str, seconds: float, prompt_digest: str,
              indices: list[int] | None = None) -> list[int]:
        """Authenticate a reader and hold the pin for `seconds`; returns the pinned block ids.
        NotReady while any of `indices` (positions in the pin) is not computed yet."""
        now = time.monotonic()
        with self._lock:
            pin = self._readable(request_id, token, prompt_digest, now, indices)
            pin.leased_until = now + seconds
            return list(pin.block_ids)

    def open_read(self, request_id: str, token: str, prompt_digest: str,
                  indices: list[int] | None = None, streamed: bool = False) -> list[int]:
        """Authenticate a read this worker serves and hold the pin until `close_read` (which the
        caller must reach, however the read ends). NotReady as `lease`, unless `streamed`: the
        read then waits for each of its blocks itself (`wait_ready`)."""
        with self._lock:
            pin = self._readable(request_id, token, prompt_digest, time.monotonic(), None if streamed else indices)
            pin.readers += 1
            return list(pin.block_ids)

    def close_read(self, request_id: str, token: str) -> None:
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is not None and pin.token == token and pin.readers > 0:
                pin.readers -= 1

    def check(self, request_id: str, token: str, prompt_digest: str) -> None:
        """PinError unless the pin is still the reader's: released or cancelled ends a read."""
        with self._lock:
            self._authenticate(request_id, token, prompt_digest, time.monotonic())

    def readiness(self, request_id: str, token: str, prompt_digest: str) -> tuple[int, list, int]:
        """(leading blocks computed, [(upto, clock)] of the launched steps computing the next
        ones (see `computing`), the pin's blocks); PinError as `check`."""
        with self._lock:
            pin = self._authenticate(request_id, token, prompt_digest, time.monotonic())
            if pin.state != RUNNING:  # a finished prefill's (or a plain pin's) blocks are all computed
                return len(pin.block_ids), [], len(pin.block_ids)
            return pin.ready, list(pin.computing), len(pin.block_ids)

    def wait_ready(self, request_id: str, token: str, prompt_digest: str, upto: int, timeout_s: float,
                   hung_up: Callable[[], bool] | None = None, computing_ok: bool = False) -> bool:
        """Wait until the pin's first `upto` blocks are computed (or, `computing_ok`, a launched
        step is computing them) (True), at most `timeout_s` (False). PinError once the pin is
        released or cancelled (the prefill was aborted: its blocks will never be computed);
        ConnectionError once `hung_up()` says the reader left."""
        return wait_ready(self._changes, lambda: self._authenticate(request_id, token, prompt_digest, time.monotonic()),
                          upto, timeout_s, hung_up, computing_ok)

    def progress(self, request_id: str, token: str, prompt_digest: str, have, lease_s: float = 0.0,
                 last_seen: bool = True, layers=None) -> dict:
        """A streamed pin's state for a reader that has seen `have` ready blocks: NotReady until
        there is more, the prefill ended, or (a reader that has not seen it, `last_seen` False)
        its last step began. Only the holder of the token may ask. `lease_s`: the
        answer is also a lease (as `lease`) on the pin, whose block ids it then carries: a NIXL
        reader READs the ready blocks at once, without a lease round trip per chunk.

        `layers` (an int: a layered reader, which holds that many leading layers of the blocks a
        launched step is writing): `ready` then also counts the blocks of launched steps whose
        forward has passed every layer (not yet collected), and `partial` [upto, layers written,
        model layers] names the step writing the next blocks, up to `upto`, once it has passed a
        layer; there is more for the reader when either moved past what it holds."""
        now = time.monotonic()
        with self._lock:
            # Cancelled is an answer here, not a refusal: the reader stops (no first token will come).
            pin = self._authenticate(request_id, token, prompt_digest, now, cancelled_ok=True)
            ready, part = pin.ready, None
            if type(layers) is int and pin.state == RUNNING:
                ready, part = _frontier(pin)
            nothing_new = pin.state == RUNNING and type(have) is int and ready <= have
            if part is not None and type(layers) is int:
                nothing_new = nothing_new and part[1] <= layers
            if nothing_new and not (pin.last and last_seen is not True):
                if part is not None:  # that step's next group of layers is news
                    raise NotReady(part[2], _next_group(max(part[1], layers), part[2].num_layers))
                raise NotReady()
            state = pin.progress()
            if type(layers) is int and pin.state == RUNNING:
                state["ready"] = ready
                if part is not None and part[1] > 0:
                    state["partial"] = [part[0], part[1], part[2].num_layers]
            if lease_s > 0 and pin.state != CANCELLED:
                pin.leased_until = now + lease_s
                state["block_ids"] = list(pin.block_ids)
            return state

    def state(self, request_id: str) -> dict | None:
        """A pin's progress for a deferred reply past its deadline (None: gone)."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None:
                return None
            return pin.progress()

    def snapshot(self, request_id: str) -> PinSnapshot | None:
        """The pin as another process mirrors it (None: gone). Launched steps whose clock has no
        shared slot are left out: the mirror then waits for their collection (`advance`)."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None:
                return None
            computing = tuple((upto, *clock.shared) for upto, clock in pin.computing
                              if getattr(clock, "shared", None) is not None)
            return PinSnapshot(pin.token, pin.prompt_digest, pin.state, pin.ready, len(pin.block_ids), computing,
                               pin.released, pin.expires_at)

    def release(self, request_id: str, token: str) -> bool:
        if not (isinstance(request_id, str) and isinstance(token, str)):
            return False
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or not secrets.compare_digest(pin.token.encode(), token.encode()):
                return False
            pin.released = True
            pin.leased_until = 0.0
        self._changed(request_id)  # a reader waiting on it learns at once
        return True

    def collect(self) -> list[tuple[str, list[int], bool]]:
        """Pins to free now: released ones, and expired ones not under lease. (id, blocks, expired)."""
        now = time.monotonic()
        out = []
        with self._lock:
            for rid, pin in list(self._pins.items()):
                if pin.leased_until > now or pin.readers:
                    continue
                if pin.released or pin.expires_at <= now:
                    out.append((rid, pin.block_ids, not pin.released))
                    del self._pins[rid]
                    if pin.state == CANCELLED:
                        self._cancelled[rid] = Pin([], pin.token, pin.prompt_digest, now + self.ttl, released=True,
                                                   state=CANCELLED)
            for rid, pin in list(self._cancelled.items()):
                if pin.expires_at <= now:
                    del self._cancelled[rid]
        return out

    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(p.block_ids) for p in self._pins.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._pins)


def _frontier(pin: Pin) -> tuple[int, tuple | None]:
    """Under the lock, a running pin: (leading blocks with every layer written, (upto, layers
    written, clock) of the launched step writing the blocks after them, or None). A step's
    blocks count as written once its forward passed the last layer, before its collection."""
    ready = pin.ready
    for upto, clock in pin.computing:
        if upto <= ready:
            continue
        done = clock.done()
        if done < clock.num_layers:
            return ready, (upto, done, clock)
        ready = upto
    return ready, None


def _next_group(layers: int, num_layers: int) -> int:
    """The layer count a reader holding `layers` waits for: the end of the next LAYER_GROUPS group."""
    group = -(-num_layers // LAYER_GROUPS)
    return min(num_layers, (layers // group + 1) * group)
