"""The workers' API key (issue 15) as the pure builders render it, and the operator's use of
the shared contract (issue 12): labels, ports and env names come from pdserve.protocol.contract,
never from literals of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pdserve.operator import naming
from pdserve.operator.optional import ROLE_META_LABEL, build_service_monitor
from pdserve.operator.spec import ModelServing, ModelServingSpec
from pdserve.operator.workloads import build_router_deployment, build_worker_deployment
from pdserve.protocol import contract

BASE = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "image": "reg/pdserve:1"}
GENERATED = {"secretKeyRef": {"name": "llama-worker-api-key", "key": "api-key"}}


def ms(worker_api_key_uid="", **spec) -> ModelServing:
    return ModelServing("llama", "ns1", "uid-1", ModelServingSpec.from_dict({**BASE, **spec}),
                        worker_api_key_uid=worker_api_key_uid)


def pod(deployment):
    return deployment["spec"]["template"]


def env(deployment):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod(deployment)["spec"]["containers"][0]["env"]}


def test_workers_accept_and_the_router_presents_the_same_generated_key():
    for role in ("prefill", "decode"):
        assert env(build_worker_deployment(ms(), role))["PDSERVE_API_KEYS"] == GENERATED
    router = env(build_router_deployment(ms()))
    assert router["PDSERVE_WORKER_API_KEY"] == GENERATED
    assert "PDSERVE_API_KEYS" not in router  # the router's own clients stay unkeyed unless router.apiKeySecret


def test_a_user_secret_replaces_the_generated_one_on_both_sides():
    m = ms(workerApiKeySecret={"name": "mine"}, router={"apiKeySecret": {"name": "clients"}})
    mine = {"secretKeyRef": {"name": "mine", "key": "api-key"}}
    assert env(build_worker_deployment(m, "decode"))["PDSERVE_API_KEYS"] == mine
    router = env(build_router_deployment(m))
    assert router["PDSERVE_WORKER_API_KEY"] == mine
    assert router["PDSERVE_API_KEYS"] == {"secretKeyRef": {"name": "clients", "key": "api-keys"}}


def test_a_users_env_entry_still_wins_by_name():
    m = ms(decode={"env": [{"name": "PDSERVE_API_KEYS", "value": "k" * 20}]})
    assert env(build_worker_deployment(m, "decode"))["PDSERVE_API_KEYS"] == "k" * 20


def test_a_recreated_generated_secret_restarts_workers_and_router_but_keeps_the_revision():
    a, b = ms(worker_api_key_uid="s-1"), ms(worker_api_key_uid="s-2")
    for build in (lambda m: build_worker_deployment(m, "prefill"), build_router_deployment):
        assert pod(build(a))["metadata"]["annotations"] == {"pdserve.io/worker-api-key-uid": "s-1"}
        assert pod(build(b))["metadata"]["annotations"] == {"pdserve.io/worker-api-key-uid": "s-2"}
        assert "annotations" not in pod(build(ms(workerApiKeySecret={"name": "mine"})))["metadata"]
    # who may call a worker is not which workers can exchange KV: the pairing revision stays
    assert naming.revision(a) == naming.revision(b)


def test_service_monitor_scrapes_workers_with_their_key_and_the_router_with_its_own():
    (workers, router) = build_service_monitor(ms())["spec"]["endpoints"]
    assert workers["bearerTokenSecret"] == {"name": "llama-worker-api-key", "key": "api-key"}
    assert workers["relabelings"][0] == {"sourceLabels": [ROLE_META_LABEL], "regex": "prefill|decode", "action": "keep"}
    assert ROLE_META_LABEL == "__meta_kubernetes_service_label_pdserve_io_role"  # Prometheus' sanitised name
    assert (workers["port"], workers["path"]) == (router["port"], router["path"]) == ("http", "/metrics")
    assert router["relabelings"][0]["regex"] == "router" and "bearerTokenSecret" not in router  # an unkeyed router

    m = ms(workerApiKeySecret={"name": "wk", "key": "k"}, router={"apiKeySecret": {"name": "clients", "key": "one"}})
    workers, router = build_service_monitor(m)["spec"]["endpoints"]
    assert workers["bearerTokenSecret"] == {"name": "wk", "key": "k"}
    assert router["bearerTokenSecret"] == {"name": "clients", "key": "one"}


# the contract ------------------------------------------------------------------------------

SHARED = {name: value for name, value in vars(contract).items()
          if name.startswith(("LABEL_", "ENV_", "HTTP_PORT", "KV_EVENTS_", "HEADER_"))}
OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def test_the_contract_names_what_the_operator_renders():
    assert {"LABEL_ROLE", "ENV_API_KEYS", "ENV_WORKER_API_KEY", "ENV_KV_SECRET", "HTTP_PORT", "HTTP_PORT_NAME"} <= set(
        SHARED
    )
    assert naming.LABEL_ROLE is contract.LABEL_ROLE


@pytest.mark.parametrize("path", sorted(OPERATOR.glob("*.py")), ids=lambda p: p.name)
def test_the_operator_spells_no_contract_value_itself(path):
    """A literal equal to a contract value (a label, port, port name or env name) would drift
    from the router's and worker's copy on the next rename."""
    literals = {(node.value, node.lineno) for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Constant) and not isinstance(node.value, bool)
                and isinstance(node.value, (str, int))}
    dupes = [(name, line) for value, line in literals for name, v in SHARED.items() if value == v]
    assert not dupes, f"{path.name}: use pdserve.protocol.contract instead of literals {sorted(dupes)}"

