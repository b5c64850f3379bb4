"""The package boundaries hold: the worker and the router each import pdserve.protocol, never
each other, and the protocol imports neither; inside the worker, each room imports only the rooms
below it (checked by parsing every module's imports, lazy ones inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(folder: str) -> dict[str, set[str]]:
    """file -> every module it imports (absolute names; relative imports are not used here)."""
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                names.add(node.module or "")
        out[str(path.relative_to(ROOT))] = names
    return out


@pytest.mark.parametrize("folder,forbidden", [
    ("worker", ("pdserve.router",)),
    ("router", ("pdserve.worker",)),
    ("protocol", ("pdserve.worker", "pdserve.router", "pdserve.operator")),
])
def test_no_import_crosses_the_boundary(folder, forbidden):
    found = imported_modules(folder)
    assert found, f"no modules found under {folder}/"
    bad = {f: sorted(m for m in mods if m.startswith(forbidden)) for f, mods in found.items()}
    assert not {f: m for f, m in bad.items() if m}


def test_the_check_sees_imports():
    # Guard against a walker that finds nothing: the worker server does import the protocol.
    assert any(m.startswith("pdserve.protocol") for m in imported_modules("worker")["worker/server/app.py"])


# The worker's rooms, bottom to top: a room imports only rooms listed before it. The request and
# its parameters sit below everything that reads them; the executor runs one step of the model
# and never sees the engine that schedules it; the server is on top.
WORKER_ROOMS = (
    "config",        # flags, the model's config.json, its FP8 format
    "quantization",  # the FP8 linear method
    "attention",     # the paged KV cache and the attention backends
    "request",       # a request, its sampling parameters, its outputs
    "structured",    # grammars
    "sample",        # logits -> tokens
    "parallel",      # tensor-parallel layers, shards, collectives
    "models",        # the model families and their loading
    "lora",          # LoRA adapters: reading them, their slots, their term in the model's linears
    "kv",            # KV transfer between workers
    "executor",      # one step on the device; the tensor-parallel rank processes
    "engine",        # the loop, the scheduler, the block manager
    "server",        # the OpenAI server
)


# Modules any room may import: the KV transports' names (config's --kv-transfer choices read them).
# The registry names its built-in transports as "module:Class" strings and imports none of them.
ROOM_FREE = ("pdserve.worker.kv.registry",)


def worker_room_violations(found: dict[str, set[str]]) -> list[str]:
    """One line per import of a room above the file's own, and per file outside a known room."""
    bad = []
    for path, mods in found.items():
        parts = Path(path).parts  # worker/<room>/...
        if len(parts) == 2:
            if parts[1] != "__init__.py":
                bad.append(f"{path}: a module in the worker root (it belongs in a room)")
            continue
        room = parts[1]
        if room not in WORKER_ROOMS:
            bad.append(f"{path}: room {room!r} is not in WORKER_ROOMS")
            continue
        allowed = set(WORKER_ROOMS[:WORKER_ROOMS.index(room) + 1])
        for m in sorted(mods):
            if m.startswith("pdserve.worker.") and m not in ROOM_FREE:
                target = m.split(".")[2]
                if target not in allowed:
                    bad.append(f"{path} imports {m} ({room} is below {target})")
    return bad


def test_worker_rooms_import_downwards_only():
    found = imported_modules("worker")
    assert {Path(p).parts[1] for p in found if len(Path(p).parts) > 2} == set(WORKER_ROOMS)
    assert not worker_room_violations(found)


def test_room_free_modules_import_no_room():
    # Type-only imports (under TYPE_CHECKING) aside, a module every room may import imports none.
    found = imported_modules("worker")
    assert {m for m in found["worker/kv/registry.py"] if m.startswith("pdserve.worker.")} <= {
        "pdserve.worker.kv.transport"}


def test_the_room_check_sees_a_violation():
    # An upward import and a module in the root are each reported.
    found = {"worker/executor/model_runner.py": {"pdserve.worker.engine.scheduler", "pdserve.worker.config.engine"},
             "worker/stray.py": set(), "worker/__init__.py": set()}
    assert worker_room_violations(found) == [
        "worker/executor/model_runner.py imports pdserve.worker.engine.scheduler (executor is below engine)",
        "worker/stray.py: a module in the worker root (it belongs in a room)"]
