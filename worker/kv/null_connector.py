"""NullKVConnector: the connector of a worker that moves no KV (role both, no --kv-transfer).

It opens no port and holds no pins; the engine calls it exactly as it calls KVConnector, and
every order is empty, nothing ever finishes, nothing is waited for. Its scheduler half is a
KVConnectorScheduler without an endpoint: params of a remote prefill are prefilled here.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.worker.kv.connector_meta import KVConnectorMetadata, KVConnectorOutput


class NullKVConnector:
    # Whether KV moves: a P/D worker waits for each step at collection (its KV must be written
    # before a pin makes it readable, and before a pull may write into freed blocks).
    active = False
    transport = None
    clock_ring = None  # no TCP senders' process reads this worker's layer clocks

    def endpoint(self) -> None:
        return None

    def apply(self, meta: KVConnectorMetadata) -> None:
        pass

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def computing(self, orders, clock) -> None:
        pass

    def pull_landing(self) -> bool:
        return False

    def wait_for_landing(self, until: Callable[[], bool], poll_s: float = 100e-6) -> bool:
        return False

    def wait_for_loads(self, timeout: float) -> None:
        pass  # no pull will land: nothing to wait for

    def observe_decode_waits(self, admitted_s: float | None, landed_s: float | None) -> None:
        pass

    def health(self) -> None:
        return None

    def collectors(self) -> list:
        return []

    def shutdown(self) -> None:
        pass
