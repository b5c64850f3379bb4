"""Incremental detokenization with stop strings, one request at a time.

Token ids arrive a few at a time; the text handed out must be final: never half of a UTF-8
character, never text that a later token could turn into a stop string. Two hold-backs do that:

1. Byte-level BPE splits multi-byte characters over several tokens, so the text of a token
   window is decoded as a whole and a trailing U+FFFD (the decoder's mark for an incomplete
   character) keeps those tokens pending until the character completes.
2. The longest tail of the text that is a prefix of some stop string stays held until it
   either becomes the stop string (text cut before it, finish) or cannot any more. Only that
   tail plus the new text is searched (stop_strings.py): a step's stop check costs the same
   at the output's first token and its ten-thousandth.

Decoding uses a sliding window (`_prefix_offset`, `_read_offset`) a few tokens back into
already-decoded ids, as TGI and vLLM do: SentencePiece decoders drop a word's leading space when
it starts the decoded sequence, so a token is always decoded behind some context and only the
text past the context's own decoding is new. Work per step is O(window), not O(output).

Resuming a request another worker began (P/D): the prefill worker samples the first token and
returns only what `update()` released for it, never `flush()`: text that may still become a stop
string, or half a UTF-8 character, stays held as it would on one worker. The decode worker is
handed that token as `emitted_token_ids`; replaying `update()` over it gives exactly the text the
prefill released (counted as emitted) and the same hold-backs, so the two workers' text is
the one worker's text, split at the same place: a stop string spanning the first and second
tokens is found, and a character split over them is emitted whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.worker.request.stop_strings import StopStrings

# Tokens of context decoded before the new ones (enough for SentencePiece's space handling).
_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so byte tokens of one character number at most 4;
# past that a trailing U+FFFD is real output (a model may generate the character itself).
_MAX_PENDING_TOKENS = 4
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids into final text deltas.

    `update(ids) -> (text, stop)`: `text` is the new final text; `stop` is the stop string that
    matched (the text then ends right before it and the request should finish), else None.
    `flush() -> str`: at the end of a request that did not stop on a string, the held-back text.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] | StopStrings = (),
        skip_special_tokens: bool = True,
        emitted_token_ids: Sequence[int] = (),
    ):
        self._tokenizer = tokenizer
        # Compiled once per request (or passed in, shared by a request's detokenizers).
        self._stop = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        self.output_text = ""  # final text decoded so far, whole characters, stop string cut off
        self._emitted = 0  # chars of output_text handed out (or already sent by another worker)
        self._stop_from = 0  # no stop string can start before this char of output_text
        self.stopped: str | None = None
        if emitted_token_ids:
            # Their released text was sent by another worker. The last one alone, as that worker's
            # last output (one token) was: the next text is decoded behind the same window, so a
            # word after a token that decodes to nothing (a skipped EOS on a word-level decoder)
            # gets the space that worker would have given it, or not.
            if len(emitted_token_ids) > 1:
                self.update(emitted_token_ids[:-1])
            self.update(emitted_token_ids[-1:])

    @property
    def num_emitted_chars(self) -> int:
        """Characters of output_text handed out so far (or sent by another worker)."""
        return self._emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _decode_pending(self) -> str:
        """Text of the tokens not yet decoded, replacement characters and all."""
        if self._read_offset == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(before) :]

    def update(self, new_token_ids: Sequence[int]) -> tuple[str, str | None]:
        if self.stopped is not None:
            return "", self.stopped
        self._ids.extend(new_token_ids)
        end = len(self._ids)
        # Decode up to the last cut that does not end mid-character (try end, end-1, .., end-3).
        cut = end
        while cut > self._read_offset and end - cut < _MAX_PENDING_TOKENS:
            text = self._decode(self._ids[self._prefix_offset : cut])
            if not text.endswith(_REPLACEMENT):
                break
            cut -= 1
        else:
            if end - self._read_offset < _MAX_PENDING_TOKENS:
                return self._release()  # an incomplete character: wait for its next byte token
            cut, text = end, self._decode(self._ids[self._prefix_offset : end])  # invalid bytes
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self.output_text += text[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, cut
        return self._release()

    def _release(self) -> tuple[str, str | None]:
        """Hand out what is final: cut at the earliest stop string, hold a possible stop prefix."""
        out = self.output_text
        if self._stop:
            # Only the window from the tail held last time can hold a new stop (stop_strings.py).
            window = out[self._stop_from:]
            hit = self._stop.first_match(window)
            if hit is not None:
                at, stop = self._stop_from + hit[0], hit[1]
                self.stopped = stop
                self.output_text = out[:at]
                delta = out[self._emitted : at] if at > self._emitted else ""
                self._emitted = max(self._emitted, at)
                return delta, stop
            upto = len(out) - self._stop.held_len(window)
            self._stop_from = upto
        else:
            upto = len(out)
        if upto <= self._emitted:
            return "", None
        delta = out[self._emitted : upto]
        self._emitted = upto
        return delta, None

    def flush(self) -> str:
        """Everything still held back (the request ended without a stop string)."""
        if self.stopped is not None:
            return ""
        self.output_text += self._decode_pending()
        delta = self.output_text[self._emitted :]
        self._emitted = len(self.output_text)
        return delta
