"""The side channel's envelope and replies are parsed once, in worker/kv/messages.py: these pin
what a parse accepts and refuses (the end-to-end refusals are in test_kv_security.py)."""

import pytest

from pdserve.worker.kv.messages import Destination, MalformedReply, NixlPeer

ME = Destination("engine-a", "::1", 5557)


@pytest.mark.parametrize("to, describe, meant", [
    ({"engine_id": "engine-a", "host": "::1", "port": 5557}, False, True),
    ({"engine_id": "engine-a", "host": "0:0::1", "port": 5557}, False, True),  # addresses compare as addresses
    ({"engine_id": None, "host": "::1", "port": 5557}, True, True),  # a describe may not know the engine yet
    ({"engine_id": None, "host": "::1", "port": 5557}, False, False),  # any other op must name it
    ({"engine_id": "engine-b", "host": "::1", "port": 5557}, False, False),
    ({"engine_id": "engine-a", "host": "::1", "port": 5558}, False, False),
    ({"engine_id": "engine-a", "host": "::1", "port": True}, False, False),  # a bool is no port
    ({"engine_id": "engine-a", "host": "::1", "port": 5557.0}, False, False),  # nor is a float
    ({"engine_id": "engine-a", "host": "127.0.0.1", "port": 5557}, False, False),
    ({"engine_id": "engine-a", "host": ["::1"], "port": 5557}, False, False),
])
def test_a_destination_names_only_its_worker(to, describe, meant):
    assert Destination.of_request({"to": to}).names(ME, describe=describe) is meant


@pytest.mark.parametrize("body", [{}, {"to": None}, {"to": "engine-a"}, {"to": ["::1", 5557]}])
def test_a_request_without_a_destination_is_refused(body):
    with pytest.raises(PermissionError, match="names no destination"):
        Destination.of_request(body)


def test_a_destination_round_trips_the_wire_form():
    assert Destination.of_request({"to": ME.to_body()}) == ME
    assert "engine-a" in str(ME) and "5557" in str(ME)


def test_a_nixl_peer_description_missing_its_metadata_is_malformed():
    with pytest.raises(MalformedReply):
        NixlPeer.parse({"agent": "x"}, "prefill at h:1")
