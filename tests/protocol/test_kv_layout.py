"""KVLayout: the wire string reads back to the same value and is written back byte for byte; a
string no worker writes is refused, saying why; layouts compare as values (pure)."""

from __future__ import annotations

import pytest

from pdserve.protocol.kv_layout import KVLayout


@pytest.mark.parametrize("text,layout", [
    ("2x4x16:float32:4", KVLayout(2, 4, 16, "float32", 4)),
    ("32x8x128:bfloat16:16", KVLayout(32, 8, 128, "bfloat16", 16)),
    ("28x2x64:float8_e4m3fn@1:16", KVLayout(28, 2, 64, "float8_e4m3fn", 16, "1")),
    ("28x2x64:float8_e4m3fn@0a1b2c3d4e5f:16", KVLayout(28, 2, 64, "float8_e4m3fn", 16, "0a1b2c3d4e5f")),
    ("24x8x64:bfloat16:16:w128/555555", KVLayout(24, 8, 64, "bfloat16", 16, None, 128, tuple(range(0, 24, 2)))),
    ("2x2x16:float8_e4m3fn@1:4:w8/1", KVLayout(2, 2, 16, "float8_e4m3fn", 4, "1", 8, (0,))),
])
def test_the_wire_form_reads_back_to_the_same_value(text, layout):
    assert KVLayout.parse(text) == layout and str(layout) == text


def test_layouts_compare_as_values():
    fp8 = KVLayout.parse("28x2x64:float8_e4m3fn@1:16")
    assert fp8.element == "float8_e4m3fn@1" and fp8.block_size == 16
    assert fp8 != KVLayout.parse("28x2x64:float8_e4m3fn@0a1b2c3d4e5f:16")  # other scales: other values
    assert fp8 != KVLayout.parse("28x2x64:bfloat16:16") and fp8 != KVLayout.parse("28x2x64:float8_e4m3fn@1:32")


@pytest.mark.parametrize("text,says", [
    ("2x4x16:float32:four", "does not end in a block size"),
    ("2x4x16:float32", "does not end in a block size"),
    ("layout:16", "is not <layers>x<kv heads>x<head dim>"),
    ("2x4:float32:16", "is not <layers>x<kv heads>x<head dim>"),
    ("02x4x16:float32:16", "is not <layers>x<kv heads>x<head dim>"),  # another spelling of a layout
    ("2x2x16:float32:4:w8/0", "is not <layers>x<kv heads>x<head dim>"),  # a window without sliding layers
    ("2x2x16:float32:4:w0/1", "is not <layers>x<kv heads>x<head dim>"),  # sliding layers without a window
    ("2x2x16:float32:4:w8/01", "is not <layers>x<kv heads>x<head dim>"),  # another spelling of the mask
])
def test_a_string_no_worker_writes_is_refused(text, says):
    with pytest.raises(ValueError, match=says):
        KVLayout.parse(text)


def test_a_hybrid_layout_and_a_plain_one_differ_and_count_their_hand_off():
    """A hybrid cache's hand-off: every prompt block, then the sliding group's blocks from the
    window of the first decode query (position = prompt length) on."""
    hybrid = KVLayout.parse("2x2x16:float32:4:w8/1")
    plain = KVLayout.parse("2x2x16:float32:4")
    assert hybrid != plain and hybrid.hybrid and not plain.hybrid
    # 30 tokens: 8 blocks; the query at position 30 reads keys 23.. (block 5 on): 8 + 3 blocks.
    assert hybrid.sliding_start(30) == 5 and hybrid.handoff_blocks(30) == 11
    assert plain.handoff_blocks(30) == 8
    assert hybrid.handoff_blocks(5) == 2 + 2  # within one window: every sliding block too


def test_an_mla_latent_layout_never_equals_a_gqa_one():
    """One 40-value latent per token and layer (MLA) and one 40-value K and V head (GQA) have the
    same numbers; the ":mla" suffix keeps a GQA peer from reading latent blocks, and back."""
    mla, gqa = KVLayout(2, 1, 40, "bfloat16", 16, latent=True), KVLayout(2, 1, 40, "bfloat16", 16)
    assert str(mla) == "2x1x40:bfloat16:16:mla" and str(gqa) == "2x1x40:bfloat16:16"
    assert KVLayout.parse(str(mla)) == mla and KVLayout.parse(str(gqa)) == gqa and mla != gqa
