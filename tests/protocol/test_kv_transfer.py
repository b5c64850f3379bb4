"""KVTransferParams: what a prefill worker hands over parses back to the same object, and every
malformed or incompatible field is refused with a message naming it (table-driven, pure)."""

from __future__ import annotations

import pytest

from pdserve.protocol.kv_transfer import (KVTransferParams, KVTransferParamsError, RemoteDecodeRequest,
                                          is_remote_decode, is_streamed, parse_kv_transfer_params, prefill_request,
                                          wants_remote_decode, wants_stream_kv)

GOOD = {"remote_engine_id": "e1", "remote_host": "10.0.0.1", "remote_port": 5600, "remote_request_id": "r1",
        "remote_block_ids": [3, 4, 5], "num_prompt_tokens": 9, "first_token_id": 42, "transfer_token": "t",
        "expires_at": 1.5e9, "kv_layout": "2x4x16:float32:4", "transport": "nixl", "kv_tp_size": 2}


def test_round_trip():
    p = KVTransferParams.from_dict(GOOD)
    assert p.to_dict() == GOOD and p.block_size == 4 and p.remote_block_ids == (3, 4, 5)
    older = KVTransferParams.from_dict(
        {k: v for k, v in GOOD.items() if k not in ("transport", "expires_at", "kv_tp_size")}
    )
    assert older.transport == "tcp" and older.kv_tp_size == 1  # a sender that predates a field gets its default
    lora = {**GOOD, "lora_name": "sql", "lora_path": "/adapters/sql"}  # the adapter and where it comes from
    assert KVTransferParams.from_dict(lora).to_dict() == lora


@pytest.mark.parametrize("change,says", [
    ({"remote_port": "5600"}, "remote_port is missing or not a int"),
    ({"first_token_id": True}, "first_token_id is missing or not a int"),
    ({"remote_host": None}, "remote_host is missing"),
    ({"remote_block_ids": [1, "2", 3]}, "list of integers"),
    ({"remote_block_ids": [1, 2]}, "do not cover num_prompt_tokens"),
    ({"kv_layout": "2x4x16:float32:four"}, "does not end in a block size"),
    ({"kv_layout": "2x4x16:float32:0"}, "do not cover"),
    ({"transport": 3}, "transport must be a string"),
    ({"kv_tp_size": 0}, r"kv_tp_size must be an integer in \[1, 64\]"),
    ({"kv_tp_size": "2"}, r"kv_tp_size must be an integer"),
    ({"kv_tp_size": True}, r"kv_tp_size must be an integer"),
    ({"lora_path": "/adapters/sql"}, "lora_path must be a non-empty string, with lora_name"),
    ({"lora_name": "sql", "lora_path": ""}, "lora_path must be a non-empty string"),
])
def test_malformed_params_are_refused(change, says):
    with pytest.raises(KVTransferParamsError, match=says) as e:
        KVTransferParams.from_dict({**GOOD, **change})
    assert e.value.param == "kv_transfer_params"


@pytest.mark.parametrize("num_prompt_tokens,block_size,vocab,says", [
    (9, 4, 42, "out of the vocabulary"),
    (8, 4, 100, "describe 9 prompt tokens but the prompt has 8"),
    (9, 8, 100, "block size is 4 but this worker's is 8"),
])
def test_incompatible_params_are_refused(num_prompt_tokens, block_size, vocab, says):
    with pytest.raises(KVTransferParamsError, match=says):
        KVTransferParams.from_dict(GOOD).check_compatible(num_prompt_tokens, block_size, vocab)


@pytest.mark.parametrize("raw,expected", [
    (None, None),
    ({}, None),
    ({"do_remote_decode": True}, RemoteDecodeRequest()),
    ({"do_remote_decode": True, "stream_kv": True, "decode_budget": {"max_tokens": 5}},
     RemoteDecodeRequest({"max_tokens": 5}, True)),
    ({"do_remote_decode": True, "stream_kv": "yes", "decode_budget": 7}, RemoteDecodeRequest()),  # lenient, as before
    (GOOD, KVTransferParams.from_dict(GOOD)),
])
def test_one_parse_into_the_object_the_engine_carries(raw, expected):
    parsed = parse_kv_transfer_params(raw)
    assert parsed == expected and parse_kv_transfer_params(parsed) is parsed  # parsed objects pass through
    if parsed is not None:  # the predicates read the object as they read the dict
        assert (is_remote_decode(parsed), wants_remote_decode(parsed)) == (
            is_remote_decode(raw),
            wants_remote_decode(raw),
        )
        assert (is_streamed(parsed), wants_stream_kv(parsed)) == (is_streamed(raw), wants_stream_kv(raw))
    if isinstance(parsed, RemoteDecodeRequest) and raw.get("stream_kv") != "yes":
        assert parsed.to_dict() == raw  # the wire form is unchanged


def test_a_malformed_decode_request_is_refused_by_the_one_parse():
    with pytest.raises(KVTransferParamsError, match="first_token_id is missing"):
        parse_kv_transfer_params({**GOOD, "first_token_id": None})
    with pytest.raises(KVTransferParamsError, match="must be an object"):
        parse_kv_transfer_params([1])


@pytest.mark.parametrize("params,remote_decode,wants", [
    (None, False, False),
    ({}, False, False),
    ({"do_remote_decode": True}, False, True),
    (GOOD, True, False),
    ({"first_token_id": 5}, True, False),  # a decode request, malformed: from_dict refuses it
])
def test_predicates(params, remote_decode, wants):
    assert is_remote_decode(params) is remote_decode and wants_remote_decode(params) is wants


@pytest.mark.parametrize(
    "body,expected",
    [
        (
            {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}},
            {
                "prompt": "x",
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "decode_budget": {"max_tokens": 50}},
            },
        ),
        (
            {"messages": [], "max_completion_tokens": 50, "min_tokens": 3},
            {
                "messages": [],
                "max_completion_tokens": 1,
                "max_tokens": 1,
                "min_tokens": 1,
                "stream": False,
                "kv_transfer_params": {
                    "do_remote_decode": True,
                    "decode_budget": {"max_completion_tokens": 50, "min_tokens": 3},
                },
            },
        ),
        # The decode worker's defaults: completions 16, chat whatever fits (no budget to check).
        (
            {"prompt": "x"},
            {
                "prompt": "x",
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "decode_budget": {"max_tokens": 16}},
            },
        ),
        (
            {"messages": [], "max_tokens": None},
            {"messages": [], "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}},
        ),
    ],
)
def test_prefill_request(body, expected):
    assert prefill_request(body) == expected


def test_a_peer_prefix_pin_parses_for_a_whole_request_and_for_a_prefill():
    from pdserve.protocol.kv_transfer import PrefixPull, prefix_source

    whole = parse_kv_transfer_params({"prefix_from": GOOD})
    assert isinstance(whole, PrefixPull) and whole.to_dict() == {"prefix_from": GOOD}
    assert prefix_source(whole) == KVTransferParams.from_dict(GOOD)
    assert not (is_remote_decode(whole) or wants_remote_decode(whole) or is_streamed(whole) or wants_stream_kv(whole))
    prefill = parse_kv_transfer_params({"do_remote_decode": True, "stream_kv": True, "prefix_from": GOOD})
    assert isinstance(prefill, RemoteDecodeRequest) and prefill.stream_kv
    assert prefix_source(prefill) == KVTransferParams.from_dict(GOOD) and prefill.to_dict()["prefix_from"] == GOOD
    assert prefix_source(KVTransferParams.from_dict(GOOD)) is None
    with pytest.raises(KVTransferParamsError, match="prefix_from: kv_transfer_params.remote_port"):
        parse_kv_transfer_params({"prefix_from": {**GOOD, "remote_port": "x"}})
    with pytest.raises(KVTransferParamsError, match="not with a hand-off"):
        parse_kv_transfer_params({**GOOD, "prefix_from": GOOD})
