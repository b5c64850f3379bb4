"""The tokenizer `pdserve bench serve` measures prompts with.

`--tokenizer` wins. Without it the server is asked: the `root` of its `/v1/models` card (vLLM's
field, which pdserve's workers and router fill in) names what the model was loaded from; a
directory that exists on this machine is used as is (after `pdserve up` the model is on this
disk). Otherwise a hub id is tried (that `root`, then `--model`): from the local Hugging Face
cache, then from the hub if it answers. Every failure is quick and says to pass `--tokenizer`:
transformers alone retries an unreachable hub for most of a minute.
"""

from __future__ import annotations

import json
import os
import urllib.request

HUB_TIMEOUT_S = 5.0
SERVER_TIMEOUT_S = 5.0


class TokenizerNotFound(ValueError):
    pass


def server_root(base_url: str, model: str, timeout_s: float = SERVER_TIMEOUT_S) -> str | None:
    """The `root` of `model`'s card in the server's /v1/models, or None (no card, no root, no answer)."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            cards = json.loads(r.read()).get("data") or []
    except (OSError, ValueError, AttributeError):
        return None
    for card in cards:
        if isinstance(card, dict) and card.get("id") == model and isinstance(card.get("root"), str):
            return card["root"] or None
    return None


def _path_like(name: str) -> bool:
    """Not a hub id (`name` or `org/name`): a filesystem path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def _from_hub(name: str):
    """A hub id's tokenizer: the local cache first, then the hub, if it answers within seconds."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from transformers import AutoTokenizer

    for file in ("tokenizer_config.json", "tokenizer.json"):
        # Looked up on disk only: transformers' local_files_only still makes a call to the hub.
        cached = try_to_load_from_cache(name, file)
        if isinstance(cached, str):
            try:
                return load(os.path.dirname(cached))
            except TokenizerNotFound:  # a partial snapshot: the hub may complete it
                break
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise TokenizerNotFound(f"{name!r} is not a model on the Hugging Face hub (nor in its local cache)") from None
    except Exception as e:
        status = getattr(getattr(e, "response", None), "status_code", None) if isinstance(e, HfHubHTTPError) else None
        if status is None or status >= 500:  # unreachable, offline (HF_HUB_OFFLINE) or failing: no minute of retries
            raise TokenizerNotFound(f"{name!r} is not in the local Hugging Face cache and the hub did not answer "
                                    f"({type(e).__name__}{f' {status}' if status else ''})") from None
        # Gated or private (401, 403): the download below says what is missing.
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise TokenizerNotFound(f"{name!r}: {e}") from None


def load(name: str):
    """A directory's tokenizer, or a hub id's (see _from_hub)."""
    if os.path.isdir(name):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:
            raise TokenizerNotFound(f"{name!r}: {e}") from None
    if _path_like(name):
        raise TokenizerNotFound(f"{name!r}: no such directory")
    return _from_hub(name)


def resolve(explicit: str | None, base_url: str, model: str, say=lambda msg: None):
    """(tokenizer, where it came from). Raises TokenizerNotFound naming everything tried."""
    if explicit:
        return load(explicit), explicit
    root = server_root(base_url, model)
    if root and os.path.isdir(root):
        say(f"tokenizer: {root} (the served model's root, from /v1/models)")
        return load(root), root
    tried = []
    for name in dict.fromkeys(n for n in (root, model) if n and not _path_like(n)):
        try:
            tokenizer = load(name)
        except TokenizerNotFound as e:
            tried.append(str(e))
            continue
        say(f"tokenizer: {name} (hub id, {'the served model root' if name == root else '--model'})")
        return tokenizer, name
    if root and _path_like(root):
        tried.insert(0, f"the server's model root {root!r} is not a directory on this machine")
    elif not root:
        tried.insert(0, "the server's /v1/models names no root for this model")
    raise TokenizerNotFound("; ".join(tried))
