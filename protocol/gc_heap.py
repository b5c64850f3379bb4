"""The startup heap, frozen out of the garbage collector's reach once a server is ready.

A worker's heap after start-up (torch, the model's modules, tokenizer, FastAPI) is hundreds of
thousands of objects that live as long as the process. CPython's full collection walks all of
them every time enough younger objects have survived into the oldest generation: on this CPU
that was ~250 ms of one worker's CPU per collection, and anything that keeps objects alive for a
few seconds (in-flight requests, a tracing export queue) makes those collections more frequent.
`gc.freeze()` moves what exists now into a permanent generation that collections skip (vLLM
does the same at start-up); collecting first leaves no start-up garbage in it.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("pdserve.gc")


def freeze_startup_heap() -> None:
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("startup heap frozen: %d objects out of the collector's reach (%.0f ms)", gc.get_freeze_count(),
             (time.perf_counter() - t0) * 1e3)
