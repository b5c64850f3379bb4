"""A KV transport is one KVTransport implementation plus its registration (worker/kv/registry.py):
a third one, registered here in a few lines, carries a real prefill -> decode hand-off between
two engines (one process, real side channel on loopback), picked by its name alone."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pdserve.protocol.flags import ConfigError
from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.kv import registry
from pdserve.worker.kv.tcp_transport import TcpTransport
from pdserve.worker.request.sampling_params import SamplingParams
from tests.checkpoints import write_checkpoint, write_word_tokenizer
from tests.net import free_port

PROMPT = list(range(100, 137))  # 10 blocks of 4, the last one partial
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class SameHostTransport(TcpTransport):
    """A stand-in for a same-host transport: TCP's reads under its own name, counted."""

    name = "same-host"
    calls: Counter = Counter()

    def serve(self, conn) -> dict:
        return {}  # the base transport's `read` serves its readers

    def pull(self, *args, **kwargs) -> int:
        self.calls["pull"] += 1
        return super().pull(*args, **kwargs)


@pytest.fixture
def same_host():
    registry.register(SameHostTransport.name, SameHostTransport)
    SameHostTransport.calls.clear()
    yield SameHostTransport.name
    registry.unregister(SameHostTransport.name)


def engine(ckpt, role: str, transport: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), device="cpu", role=role, kv_transfer=transport,
                                  kv_port=free_port(), block_size=4, kv_cache_memory=8 << 20, max_model_len=256,
                                  kv_peer_allow=("127.0.0.1",), kv_secret="registry-test-secret", **kw))


def test_a_registered_transport_carries_the_handoff(tmp_path, same_host):
    ckpt = write_checkpoint(tmp_path / "m", "llama", write_word_tokenizer(tmp_path / "tok"), hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2)
    p = engine(ckpt, "prefill", same_host)
    d = engine(ckpt, "decode", same_host, enable_prefix_caching=False)
    try:
        assert p.kv_connector.kv.name == d.kv_connector.kv.name == same_host
        expected = d.generate([PROMPT], GREEDY)[0]
        p.add_request("p0", PROMPT, GREEDY, {"do_remote_decode": True})
        out = []
        while not out:
            out = [o for o in p.step() if o.finished]
        params = out[0].kv_transfer_params
        assert params.transport == same_host  # the prefill side names its transport in the params
        d.add_request("d0", PROMPT, GREEDY, params)
        tokens, deadline = [params.first_token_id], time.monotonic() + 60
        while len(tokens) < GREEDY.max_tokens:
            assert time.monotonic() < deadline, "decode did not finish"
            tokens += [t for o in d.step() if o.request_id == "d0" for t in o.new_token_ids]
        assert tokens == expected
        assert SameHostTransport.calls["pull"] == 1  # the decode side read with it, not with the base
        metrics = d.kv_connector.metrics
        assert metrics.bytes.labels("recv", same_host)._value.get() == 10 * d.kv_cache.block_bytes
        assert metrics.local_prefill_fallbacks._value.get() == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_the_registry_is_where_names_are_checked(same_host):
    assert same_host in registry.names() and registry.installed(same_host)
    registry.check(same_host)
    assert EngineConfig(kv_transfer=same_host).kv_transfer == same_host
    with pytest.raises(ConfigError, match="--kv-transfer"):
        registry.check("carrier-pigeon")
    with pytest.raises(ConfigError, match="--kv-transfer"):
        EngineConfig(kv_transfer="carrier-pigeon")
    registry.unregister(same_host)
    with pytest.raises(ConfigError, match="--kv-transfer"):
        registry.check(same_host)
    with pytest.raises(ValueError):
        registry.unregister(registry.BASE)
