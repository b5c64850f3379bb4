"""spec.lora (operator/lora.py, operator/lora_sync.py): the pure builders put --enable-lora, the
slots and the runtime-update switch on every worker of both roles, and keep the adapter list out
of the pod template (adding or removing an adapter rolls nothing out); the planner's diff; and
the live update against a real in-process worker's runtime endpoints."""

from __future__ import annotations

import time

import pytest

from pdserve.operator import lora, naming
from pdserve.operator.lora import Load, Unload
from pdserve.operator.spec import ModelServing, ModelServingSpec, SpecError
from pdserve.operator.workloads import build_worker_deployment

BASE = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "servedName": "llama"}, "image": "reg/pdserve:1"}


def ms(adapters, **lora_fields) -> ModelServing:
    spec = {**BASE, "lora": {"adapters": adapters, **lora_fields}}
    return ModelServing("llama", "ns1", "uid-1", ModelServingSpec.from_dict(spec))


def container(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_every_worker_gets_lora_flags_and_the_adapter_list_stays_out_of_the_pod_template():
    sql = {"name": "sql", "source": "pvc://adapters/sql"}
    chat = {"name": "chat", "source": "hf://org/chat-lora"}
    one = ms([sql], maxCpuLoras=8)
    for role in ("prefill", "decode"):
        dep = build_worker_deployment(one, role)
        c = container(dep)
        args = c["args"]
        assert args[args.index("--enable-lora"):][:5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
        assert args[args.index("--max-cpu-loras") + 1] == "8" and "--lora-modules" not in args
        assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"} in c["env"]
        claim = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"].startswith("lora-")]
        assert claim == [{"name": "lora-0", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}}]
        assert {"name": "lora-0", "mountPath": "/adapters/adapters", "readOnly": True} in c["volumeMounts"]
        # Another adapter (on the hub, or on the mounted claim) or one fewer: the same template.
        for adapters in ([sql, chat], [sql, {"name": "x", "source": "pvc://adapters/x"}], [sql, chat][:1]):
            other = ms(adapters, maxCpuLoras=8)
            assert build_worker_deployment(other, role)["spec"]["template"] == dep["spec"]["template"]
            assert naming.revision(other) == naming.revision(one)
    plain = ModelServing("llama", "ns1", "uid-1", ModelServingSpec.from_dict(BASE))
    assert "--enable-lora" not in container(build_worker_deployment(plain, "decode"))["args"]
    assert one.spec.lora.desired() == {"sql": "/adapters/adapters/sql"}
    assert ms([chat]).spec.lora.desired() == {"chat": "org/chat-lora"}


@pytest.mark.parametrize("adapters, extra, named", [
    ([{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}], {}, "'a' is named twice"),
    ([{"name": "llama", "source": "/x"}], {}, "base model's name"),
    ([{"name": "a", "source": "relative/dir"}], {}, "absolute path"),
    ([{"name": "a", "source": "hf://org/repo@v2"}], {}, "@revision"),
    ([{"name": "a", "source": "pvc://claim-only"}], {}, "pvc://claim/path"),
    ([], {"maxLoras": 4, "maxCpuLoras": 2}, "maxCpuLoras"),
])
def test_bad_lora_specs_are_refused_naming_the_field(adapters, extra, named):
    with pytest.raises(SpecError, match="spec.lora") as e:
        ms(adapters, **extra)
    assert named in str(e.value)


def test_the_plan_unloads_what_left_and_loads_what_is_new_or_moved():
    desired = {"a": "/p/a", "b": "/p/b2", "c": "/p/c"}
    current = {"a": "/p/a", "b": "/p/b", "old": "/p/old"}
    assert lora.plan(desired, current) == [Unload("b"), Unload("old"), Load("b", "/p/b2"), Load("c", "/p/c")]
    assert lora.plan(desired, desired) == []
    assert lora.plan({}, current) == [Unload("a"), Unload("b"), Unload("old")]


def test_sync_loads_and_unloads_on_a_real_worker(tiny_checkpoint, tmp_path, monkeypatch):
    """The worker's own runtime endpoints, in process (fastapi's TestClient is an httpx.Client):
    the spec's adapters are loaded, a removed one unloaded, a refused one named in the status."""
    from fastapi.testclient import TestClient

    from pdserve.operator.lora_sync import sync_workers
    from pdserve.worker.engine.async_engine import AsyncEngine
    from pdserve.worker.server.app import build_app
    from pdserve.worker.server.config import ServerConfig
    from tests.helpers.engines import engine_config
    from tests.lora_checkpoints import write_adapter

    base = tiny_checkpoint("llama")
    paths = {n: str(write_adapter(tmp_path / n, base, seed=i, r=4)) for i, n in enumerate(("a", "b"), 1)}
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    cfg = engine_config(base, enable_lora=True, max_loras=2)
    app = build_app(ServerConfig(), "tiny", lambda: AsyncEngine.from_config(cfg))

    def spec(**adapters) -> lora.LoRASpec:
        return lora.LoRASpec(tuple(lora.LoRAAdapter(n, p) for n, p in adapters.items()))

    with TestClient(app) as c:
        deadline = time.monotonic() + 120
        while c.get("/health").status_code != 200:  # the engine loads on a thread
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.05)
        url = str(c.base_url)
        out = sync_workers(spec(**paths), [url], c)
        assert out == {"workers": 1, "adapters": [{"name": "a", "source": paths["a"], "loadedOn": 1},
                                                  {"name": "b", "source": paths["b"], "loadedOn": 1}]}
        served = {m["id"]: m.get("parent") for m in c.get("/v1/models").json()["data"]}
        assert served == {"tiny": None, "a": "tiny", "b": "tiny"}
        out = sync_workers(spec(b=paths["b"], bad=str(tmp_path / "missing")), [url], c)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "b"]
        (b, bad) = out["adapters"]
        assert b["loadedOn"] == 1 and bad["loadedOn"] == 0 and "'bad'" in bad["error"]
        assert sync_workers(spec(b=paths["b"]), [url], c)["adapters"] == [
            {"name": "b", "source": paths["b"], "loadedOn": 1}]
        assert c.post("/v1/completions", json={"model": "b", "prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200
