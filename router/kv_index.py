"""Which worker holds which prompt prefix in its KV cache, built from the workers' KV events.

Matching does not depend on the worker's hash function: each worker's blocks are indexed by
content, (parent block hash, block token ids) -> block hash, and a prompt is walked block by
block from the root. So the router needs the prompt's token ids, never the worker's hashing
scheme (which may be salted or per-process).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _WorkerBlocks:
    block_size: int = 0
    by_content: dict[tuple[int | None, tuple[int, ...]], int] = field(default_factory=dict)
    by_hash: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)


class KVIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerBlocks] = {}

    def apply(self, worker: str, events: list[dict]) -> None:
        blocks = self._workers.setdefault(worker, _WorkerBlocks())
        for ev in events:
            kind = ev.get("type")
            if ev.get("medium", "GPU") != "GPU":
                continue  # a worker's host tier (docs/kv-cache.md): the index scores device blocks only
            if kind == "BlockStored":
                size = int(ev["block_size"])
                blocks.block_size = size
                parent = ev.get("parent_block_hash")
                tokens = ev["token_ids"]
                for i, h in enumerate(ev["block_hashes"]):
                    key = (parent, tuple(tokens[i * size:(i + 1) * size]))
                    blocks.by_content[key] = h
                    blocks.by_hash[h] = key
                    parent = h
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    key = blocks.by_hash.pop(h, None)
                    if key is not None and blocks.by_content.get(key) == h:
                        del blocks.by_content[key]
            elif kind == "AllBlocksCleared":
                blocks.by_content.clear()
                blocks.by_hash.clear()

    def clear(self, worker: str) -> None:
        self._workers.pop(worker, None)

    def block_size(self, worker: str) -> int:
        """Tokens per block of `worker`'s cache, as its events said (0: none seen yet)."""
        blocks = self._workers.get(worker)
        return blocks.block_size if blocks else 0

    def num_blocks(self, worker: str) -> int:
        blocks = self._workers.get(worker)
        return len(blocks.by_hash) if blocks else 0

    def cached_tokens(self, token_ids: list[int], workers: list[str]) -> dict[str, int]:
        """Per worker, how many leading tokens of `token_ids` its cached blocks cover."""
        return {name: n * self._workers[name].block_size for name, n in self.match(token_ids, workers).items()}

    def match(self, token_ids: list[int], workers: list[str]) -> dict[str, int]:
        """Per worker, how many leading full blocks of `token_ids` it has cached."""
        out: dict[str, int] = {}
        for name in workers:
            blocks = self._workers.get(name)
            if blocks is None or not blocks.block_size:
                continue
            size, parent, n = blocks.block_size, None, 0
            for start in range(0, len(token_ids) - size + 1, size):
                h = blocks.by_content.get((parent, tuple(token_ids[start:start + size])))
                if h is None:
                    break
                parent, n = h, n + 1
            if n:
                out[name] = n
        return out
