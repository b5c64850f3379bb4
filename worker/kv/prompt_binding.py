"""Binding a transfer to the prompt its KV was computed from.

The prefill worker pins a request's blocks under the digest of its prompt token ids and ends
the transfer token with that digest (`<random>.<digest>`): the router passes the token on
unchanged, the decode worker refuses (400) params whose digest is not its own prompt's before
allocating anything, and every lease or read names the reader's digest, which the pin checks.
The first check catches mistakes cheaply; the second holds even against a caller who forges
the suffix, because the prefill worker compares against what it computed itself.
"""

from __future__ import annotations

import hashlib
from array import array


def prompt_digest(token_ids: list[int]) -> str:
    """128-bit digest of a prompt's token ids, the same in every process."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16, person=b"pdserve-prompt").hexdigest()


def bind_token(random_part: str, digest: str) -> str:
    return f"{random_part}.{digest}"


def token_digest(token: str) -> str | None:
    """The prompt digest a transfer token was issued for (None: not a bound token)."""
    _, dot, digest = token.rpartition(".")
    return digest if dot and len(digest) == 32 else None
