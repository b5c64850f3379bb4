"""Which adapters exist, which sit in host memory, which in the GPU slots.

- The registry: the names requests may ask for (--lora-modules, /v1/load_lora_adapter) and
  where each was read from. An unloaded name leaves it at once; requests already running keep
  their adapter until they finish (its weights stay cached, re-read from disk if evicted).
- The host cache: up to --max-cpu-loras adapters read and checked (adapter.py), least recently
  used dropped first.
- The GPU slots: --max-loras of them, in every LoRA layer's stacked matrices (layer.py). Each
  step asks for its adapters (`slots_for`); one not in a slot takes the least recently used slot
  that no adapter of this step holds. The scheduler admits no more distinct adapters than
  slots, so one is always free. The swaps decided travel in the step's plan and every rank
  applies them (`apply`) before its forward, each copying its own shard; the copy is queued on
  the step's stream, after the steps before it: the engine never stops for a swap.

Reading an adapter (disk, checks) runs on the caller's thread (the server's, off its loop); the
engine thread then only registers the result, or swaps in what the cache holds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch

from pdserve.worker.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from pdserve.worker.lora.layer import LoRAContext, attach_lora, lora_ops
from pdserve.worker.config.lora_modules import LoRAModule

log = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model, *, max_loras: int, max_rank: int, max_cpu_loras: int, max_tokens: int,
                 backend_name: str, device: torch.device):
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.ctx = LoRAContext(max_tokens, device)
        self.layers, self.shapes = attach_lora(model, max_loras, max_rank, lora_ops(backend_name), self.ctx)
        self.dtype = model.embed_tokens.weight.dtype
        self._lock = threading.Lock()
        self._served: dict[str, LoRAModule] = {}  # what requests may name
        self._known: dict[str, LoRAModule] = {}  # also unloaded names whose requests may still run
        # name -> (what it was read from, the adapter), least recently used first
        self._host: OrderedDict[str, tuple[LoRAModule, LoRAAdapter]] = OrderedDict()
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # in a GPU slot; least recently used first
        self._free_slots = list(range(max_loras))
        self.num_swaps = 0  # adapters copied into a slot (metrics, tests)

    # -- the registry (any thread) ----------------------------------------------------------------

    def read(self, module: LoRAModule) -> LoRAAdapter:
        """Read and check an adapter (LoRAError naming it); changes nothing here."""
        return read_adapter(module.name, module.path, self.shapes, self.max_rank, self.dtype)

    def add(self, module: LoRAModule, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Serve `module` under its name (read here unless `adapter` is given). LoRAError: the
        name is taken, or the adapter is refused; nothing is registered then."""
        with self._lock:
            if module.name in self._served:
                raise LoRAError(f"adapter {module.name!r} is already loaded")
        adapter = adapter or self.read(module)
        with self._lock:
            if module.name in self._served:
                raise LoRAError(f"adapter {module.name!r} is already loaded")
            if module.name in self._slot_of or module.name in self._host:  # a former adapter of that name
                self._forget(module.name)
            self._served[module.name] = self._known[module.name] = module
            self._cache(module, adapter)
        log.info("LoRA adapter %s: rank %d, %d projections, from %s", module.name, adapter.rank,
                 len(adapter.weights), adapter.path)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name` (LoRAError if it is not served); running requests finish with it."""
        with self._lock:
            if self._served.pop(name, None) is None:
                raise LoRAError(f"adapter {name!r} is not loaded")

    def served(self) -> list[LoRAModule]:
        with self._lock:
            return list(self._served.values())

    def serves(self, name: str) -> bool:
        return name in self._served

    def path_of(self, name: str) -> str | None:
        """Where `name` was read from, as another worker can read it: a directory made absolute
        (a relative --lora-modules path means nothing on another host's working directory), or
        the hub id as given. A hand-off carries it (kv_transfer_params.lora_path)."""
        module = self._known.get(name)
        if module is None:
            return None
        return os.path.abspath(module.path) if os.path.isdir(module.path) else module.path

    def _cache(self, module: LoRAModule, adapter: LoRAAdapter) -> None:
        self._host[module.name] = (module, adapter)
        self._host.move_to_end(module.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _adapter(self, module: LoRAModule) -> LoRAAdapter:
        """The adapter from the host cache, else read again (the same files: they were checked)."""
        cached = self._host.get(module.name)
        adapter = cached[1] if cached is not None and cached[0] == module else self.read(module)
        self._cache(module, adapter)
        return adapter

    def _forget(self, name: str) -> None:
        """A name loaded again after an unload: drop the old weights everywhere. A request of the
        old adapter still running then continues with the new ones (requests name adapters by
        name, as vLLM's do)."""
        self._host.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free_slots.append(slot)

    # -- the GPU slots (the engine's thread) ------------------------------------------------------

    def slots_for(self, names: Iterable[str]) -> tuple[dict[str, int], list[tuple[int, LoRAModule]]]:
        """A GPU slot for each adapter of a step (at most max_loras distinct names), and the swaps
        that put those not in one there ((slot, adapter) pairs for `apply`, on every rank)."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters; the scheduler admits at most {self.max_loras}")
        out, swaps = {}, []
        with self._lock:
            for name in wanted:
                if name in self._slot_of:
                    self._slot_of.move_to_end(name)
                    out[name] = self._slot_of[name]
            for name in wanted:
                if name in out:
                    continue
                if self._free_slots:
                    slot = self._free_slots.pop()
                else:
                    victim = next(n for n in self._slot_of if n not in wanted)
                    slot = self._slot_of.pop(victim)
                self._slot_of[name] = out[name] = slot
                swaps.append((slot, self._known[name]))
        return out, swaps

    def apply(self, swaps: list[tuple[int, LoRAModule]]) -> None:
        """Copy each swapped-in adapter into its slot (this rank's shard of it)."""
        with self._lock:
            for slot, module in swaps:
                adapter = self._adapter(module)
                for layer in self.layers:
                    layer.write(slot, adapter)
                self.num_swaps += 1

    def loaded_in_slots(self) -> list[str]:
        with self._lock:
            return list(self._slot_of)
