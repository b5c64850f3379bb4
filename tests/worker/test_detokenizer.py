"""IncrementalDetokenizer on the real SmolLM2 tokenizer (byte-level BPE that splits emoji and CJK
characters over several tokens)."""

from __future__ import annotations

import pytest

from pdserve.worker.engine.detokenizer import IncrementalDetokenizer

TEXT = "Héllo 世界! 🎉 The capital of France is Paris.\n\nDone ✓ 👍🏽 end"


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.apply_chat_template([{"role": "user", "content": "Say something."}], add_generation_prompt=True)[
        "input_ids"
    ]


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _run(det, ids, step=1):
    deltas, stop = [], None
    for i in range(0, len(ids), step):
        delta, stop = det.update(ids[i : i + step])
        deltas.append(delta)
        if stop is not None:
            break
    return deltas, stop


def test_text_splits_characters_over_tokens(tok):
    # The premise of the hold-back tests: some single tokens do not decode to whole characters.
    assert any("\ufffd" in tok.decode([i]) for i in _ids(tok, TEXT))


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_deltas_are_whole_characters_and_sum_to_decode(tok, prompt, step):
    ids = _ids(tok, TEXT)
    det = IncrementalDetokenizer(tok, prompt)
    deltas, stop = _run(det, ids, step)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + det.flush() == TEXT == tok.decode(ids)
    assert det.flush() == ""


def test_stop_string_cuts_text_and_is_reported(tok, prompt):
    ids = _ids(tok, TEXT)
    det = IncrementalDetokenizer(tok, prompt, stop=("Paris",))
    deltas, stop = _run(det, ids)
    assert stop == "Paris"
    assert "".join(deltas) == TEXT[: TEXT.index("Paris")]
    assert det.flush() == "" and det.update(ids[:1]) == ("", "Paris")


def test_possible_stop_prefix_is_held_until_decided(tok, prompt):
    # "\n\n" is the stop; the first "\n" must not be emitted before we know the second follows.
    ids = _ids(tok, "a\nb\n\nc")
    det = IncrementalDetokenizer(tok, prompt, stop=("\n\n",))
    seen = ""
    for i in ids:
        delta, stop = det.update([i])
        seen += delta
        assert not seen.endswith("\n") or stop is not None
        if stop:
            break
    assert (seen, stop) == ("a\nb", "\n\n")


def test_stop_prefix_that_does_not_complete_is_released(tok, prompt):
    ids = _ids(tok, "The cap is here")
    det = IncrementalDetokenizer(tok, prompt, stop=("capital",))
    deltas, stop = _run(det, ids)
    assert stop is None
    assert "".join(deltas) + det.flush() == "The cap is here"


def test_stop_string_spanning_tokens_and_earliest_wins(tok, prompt):
    ids = _ids(tok, TEXT)
    det = IncrementalDetokenizer(tok, prompt, stop=("France is", "e cap", "zzz"))
    deltas, stop = _run(det, ids, step=4)
    assert stop == "e cap"
    assert "".join(deltas) == TEXT[: TEXT.index("e cap")]


def test_stop_string_inside_a_multibyte_run(tok, prompt):
    ids = _ids(tok, TEXT)
    det = IncrementalDetokenizer(tok, prompt, stop=("界",))
    deltas, stop = _run(det, ids)
    assert stop == "界" and "".join(deltas) == "Héllo 世"


def test_special_tokens_skipped_or_kept(tok, prompt):
    ids = _ids(tok, "Hi") + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, prompt)
    assert "".join(_run(skip, ids)[0]) + skip.flush() == "Hi"
    keep = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    assert "".join(_run(keep, ids)[0]) + keep.flush() == "Hi" + tok.eos_token


def test_invalid_bytes_do_not_stall_forever(tok, prompt):
    # A lone lead byte repeated never forms a character; after 4 pending tokens it is output as is.
    lead = _ids(tok, "🎉")[0]
    det = IncrementalDetokenizer(tok, prompt)
    deltas, _ = _run(det, [lead] * 6)
    assert "\ufffd" in "".join(deltas)


def _single(tok, prompt, ids, stop=()):
    """What one worker returns for these generated ids: (text, stop)."""
    det = IncrementalDetokenizer(tok, prompt, stop=stop)
    deltas, hit = _run(det, ids)
    return "".join(deltas) + det.flush(), hit


def _split(tok, prompt, ids, n, stop=()):
    """P/D: the prefill worker releases (never flushes) the text of ids[:n]; the decode worker,
    handed those ids, returns the rest. (text, stop) as the client sees them."""
    head, hit = IncrementalDetokenizer(tok, prompt, stop=stop).update(ids[:n])
    if hit is not None:
        return head, hit
    det = IncrementalDetokenizer(tok, prompt, stop=stop, emitted_token_ids=ids[:n])
    deltas, hit = _run(det, ids[n:])
    return head + "".join(deltas) + ("" if hit else det.flush()), hit


@pytest.mark.parametrize("stop", [(), ("\n\n",), ("is P",), ("世界",), ("🎉 T", "xyz")])
def test_resume_at_any_split_equals_one_worker(tok, prompt, stop):
    # Every split point, including one inside a multi-byte character or a stop string.
    ids = _ids(tok, TEXT)
    want = _single(tok, prompt, ids, stop)
    for n in range(1, len(ids)):
        assert _split(tok, prompt, ids, n, stop) == want, n


def test_resume_finds_stop_string_that_began_in_emitted_text(tok, prompt):
    ids = _ids(tok, "a\n\nb")
    assert tok.decode(ids[:2]) == "a\n"  # first token(s) end in half of the stop string
    head, hit = IncrementalDetokenizer(tok, prompt, stop=("\n\n",)).update(ids[:2])
    assert (head, hit) == ("a", None)  # the "\n" is held: it may start the stop string
    det = IncrementalDetokenizer(tok, prompt, stop=("\n\n",), emitted_token_ids=ids[:2])
    deltas, stop = _run(det, ids[2:])
    assert stop == "\n\n" and "".join(deltas) == ""


def test_empty_stop_string_rejected(tok, prompt):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, prompt, stop=("",))
