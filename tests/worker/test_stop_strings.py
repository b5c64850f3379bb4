"""Stop strings matched on only the held tail plus the new text (worker/request/stop_strings.py) give what
matching the whole output gives: random texts, stop lists and tokenizations (stops spanning token
boundaries, overlapping each other, prefixes of one another), through the detokenizer's
streaming hold-back (issue 44: the old check re-sliced every prefix of the output for every stop
after every token). Derandomized: the same examples every run."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.worker.engine.detokenizer import IncrementalDetokenizer
from pdserve.worker.request.stop_strings import StopStrings

# A small alphabet, so stops occur, overlap and share prefixes often; "界" is one character of
# several UTF-8 bytes, "\n" the usual stop.
TEXT = st.text(alphabet="ab\n界", min_size=1, max_size=4)
STOPS = st.lists(st.text(alphabet="ab\n界", min_size=1, max_size=7), min_size=1, max_size=6)
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None)


def naive_first_match(text: str, stops) -> tuple[int, str] | None:
    hits = [(text.find(s), len(s), s) for s in stops if s in text]
    return None if not hits else (min(hits)[0], min(hits)[2])


def naive_held(text: str, stops) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def naive_release(text: str, stops) -> tuple[str, str | None]:
    """What may be handed out once the output is `text`: up to the earliest stop (the shortest
    at equal starts), or all but the longest tail that could still become a stop."""
    hit = naive_first_match(text, stops)
    if hit is not None:
        return text[:hit[0]], hit[1]
    return text[:len(text) - naive_held(text, stops)], None


class PieceTokenizer:
    """Token id i is the string pieces[i]; decoding concatenates (no byte-level splitting)."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, **_) -> str:
        return "".join(self.pieces[i] for i in ids)


@SETTINGS
@given(window=st.text(alphabet="ab\n界", max_size=20), stops=STOPS)
def test_matcher_equals_naive(window, stops):
    m = StopStrings(stops)
    assert m.first_match(window) == naive_first_match(window, stops)
    if naive_first_match(window, stops) is None:
        assert m.held_len(window) == naive_held(window, stops)


@SETTINGS
@given(pieces=st.lists(TEXT, min_size=1, max_size=25), stops=STOPS, data=st.data())
def test_streamed_detokenizer_equals_whole_text_matching(pieces, stops, data):
    output = "".join(pieces)
    # Stops cut from the output itself, so many examples stop, often across token boundaries.
    for _ in range(data.draw(st.integers(0, 2))):
        start = data.draw(st.integers(0, len(output) - 1))
        stops.append(output[start:start + data.draw(st.integers(1, 6))])
    prompt = [0]  # the first piece doubles as the prompt: decoding starts behind context
    det = IncrementalDetokenizer(PieceTokenizer(pieces), prompt, stops)
    ids = list(range(len(pieces)))
    seen, stop, i = "", None, 0
    while i < len(ids) and stop is None:
        n = data.draw(st.integers(1, 3))  # tokens per step
        delta, stop = det.update(ids[i:i + n])
        i += n
        seen += delta
        assert (seen, stop) == naive_release("".join(pieces[:min(i, len(ids))]), stops)
    if stop is None:
        assert seen + det.flush() == output
    else:
        assert det.flush() == "" and det.update([0]) == ("", stop)


def test_long_stop_lists_cost_only_the_window():
    """26,000 stops of 300 characters: each step touches the held tail and the new text (the
    old check walked 299 prefixes of each stop per token: ~240 ms per token on a CI core)."""
    stops = [f"{i:05d}" + "x" * 295 for i in range(26_000)]
    det = IncrementalDetokenizer(PieceTokenizer(["a", "b 0", "012", "3xx", "xy", " 00017" + "x" * 295]), [0],
                                 StopStrings(stops))
    assert det.update([1]) == ("b ", None)  # "0" may begin a stop: held
    assert det.update([2, 3]) == ("", None)  # "00123xx" begins stop 123: held
    assert det.update([4]) == ("00123xxxy", None)  # ... which "y" breaks off
    assert det.update([5]) == (" ", "00017" + "x" * 295)
