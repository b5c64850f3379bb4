"""What `pdserve bench serve` sends: prompts of exact token lengths, or prompts from a JSONL file.

Random prompts follow vLLM's random dataset: draw random token ids, decode them to text, and
re-encode, because the server only sees text and decode/encode is not a round trip for most
tokenizers (merges across token boundaries). The ids are corrected until the text encodes to
exactly the wanted length. The tokenizer's special tokens (a BOS the server adds) are counted
in that length, so the server's `usage.prompt_tokens` equals `--input-len`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_FIT_TRIES = 20


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_len: int  # tokens, as the server counts them (special tokens included)
    output_len: int  # max_tokens, sent with ignore_eos so it is also the output length
    # Multi-turn mode: which conversation this turn belongs to (None: a single-turn request) and
    # its turn; turn t is sent only once turn t-1 of the same conversation has finished.
    conversation: int | None = None
    turn: int = 0


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def _sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int, minimum: int) -> list[int]:
    """Uniform in [mean*(1-r), mean*(1+r)] as vLLM's --random-range-ratio, never below `minimum`."""
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return [max(minimum, rng.randint(lo, hi)) for _ in range(n)]


def _fit(tokenizer, ids: list[int], target: int, rng: random.Random, usable: list[int]) -> tuple[str, int]:
    """Text that encodes to exactly `target` tokens (without special tokens), and that count."""
    for _ in range(_FIT_TRIES):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == target:
            return text, target
        # Keep what the tokenizer produced (it is stable under another round trip far more
        # often than the random ids were), then trim or extend it with fresh random ids.
        ids = got[:target] if len(got) > target else got + [rng.choice(usable) for _ in range(target - len(got))]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_requests(tokenizer, n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    special = tokenizer.num_special_tokens_to_add()
    if input_len <= special:
        raise ValueError(f"--input-len must exceed the {special} special token(s) the tokenizer adds, got {input_len}")
    all_special = set(tokenizer.all_special_ids)
    usable = [i for i in range(len(tokenizer)) if i not in all_special]
    in_lens = _sample_lengths(rng, input_len, range_ratio, n, special + 1)
    out_lens = _sample_lengths(rng, output_len, range_ratio, n, 1)
    specs = []
    for in_len, out_len in zip(in_lens, out_lens):
        body = in_len - special
        text, got = _fit(tokenizer, [rng.choice(usable) for _ in range(body)], body, rng, usable)
        specs.append(RequestSpec(text, got + special, out_len))
    return specs


def file_requests(path: str | Path, tokenizer, n: int | None, output_len: int, seed: int = 0) -> list[RequestSpec]:
    """JSONL, one object a line: `prompt` (text), optional `output_len` (else --output-len).
    Lines are shuffled with the seed; with `n` larger than the file, lines repeat."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
                out = int(row.get("output_len", output_len))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": str, \"output_len\"?: int}}: {e}") from None
            if not isinstance(prompt, str) or out < 1:
                raise ValueError(f"{path}:{lineno}: prompt must be a string and output_len >= 1")
            rows.append(RequestSpec(prompt, len(tokenizer.encode(prompt)), out))
    if not rows:
        raise ValueError(f"{path}: no requests in the file")
    random.Random(seed).shuffle(rows)
    n = n or len(rows)
    return [rows[i % len(rows)] for i in range(n)]


def multi_turn_requests(tokenizer, conversations: int, turns: int, message_len: int, output_len: int,
                        seed: int = 0) -> list[RequestSpec]:
    """`conversations` x `turns` requests, turn-major (every conversation's turn 0, then turn 1, ...):
    turn t's prompt is the whole history (turn 0's message, a reply, ..., turn t-1's reply) plus a
    new message of `message_len` tokens. The replies are random text of `output_len` tokens standing
    in for the model's (the same length and the same place in the prompt, so the cache sees the
    same prefix reuse as a chat whose client resends the conversation; the model's own text is not
    waited for, so a turn's prompt never depends on sampling)."""
    if turns < 1 or conversations < 1:
        raise ValueError(f"needs at least one conversation and one turn, got {conversations} x {turns}")
    rng = random.Random(seed)
    special = tokenizer.num_special_tokens_to_add()
    all_special = set(tokenizer.all_special_ids)
    usable = [i for i in range(len(tokenizer)) if i not in all_special]

    def text(n: int) -> str:
        return _fit(tokenizer, [rng.choice(usable) for _ in range(n)], n, rng, usable)[0]

    histories = [""] * conversations
    specs: list[RequestSpec] = []
    for t in range(turns):
        for c in range(conversations):
            prompt = histories[c] + text(message_len)
            n = len(tokenizer.encode(prompt, add_special_tokens=False)) + special
            specs.append(RequestSpec(prompt, n, output_len, conversation=c, turn=t))
            histories[c] = prompt + text(output_len)
    return specs
