"""The Grafana dashboards against the metrics pdserve really exports.

A real local stack (prefill worker, decode worker, router on a tiny checkpoint, CPU) serves a few
P/D requests; then (1) every metric name any dashboard query uses must be one a running worker
or router exposes on /metrics, and (2) a real Prometheus (Debian's `prometheus` package, where
installed) scrapes that stack and evaluates every dashboard query: each must be valid PromQL,
and each must return data unless it only counts events this healthy run never had.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.charts.conftest import CHART, ROOT
from tests.net import free_port

sys.path.insert(0, str(ROOT / "charts"))
from dashboards import exprs  # noqa: E402

DASHBOARDS = {p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}
ALL_EXPRS = [(key, e) for key, d in DASHBOARDS.items() for e in exprs(d)]
# Series that exist only once the event they count happened (labelled counters get a child on
# first use); a healthy run without faults or prefix-aware routing leaves them absent.
EVENT_ONLY = {"pdserve_kv_transfer_failures_total", "pdserve_router_retries_total",
              "pdserve_router_upstream_errors_total", "pdserve_router_kv_index_blocks",
              "pdserve_router_migrations_total", "pdserve_router_flow_rejected_total"}
# Series of the host KV tier, which a worker exports only with --kv-offloading-size (refused beside
# P/D transfer, so this stack has none): tests/worker/test_kv_host_tier.py checks a tiered engine
# exports them; here they are left out of the export check and may be empty.
HOST_TIER_ONLY = {"pdserve_kv_offload_stored_blocks_total", "pdserve_kv_offload_restored_blocks_total",
                  "pdserve_kv_offload_evicted_blocks_total", "pdserve_kv_offload_bytes_total",
                  "pdserve_kv_offload_blocks", "pdserve_kv_offload_total_blocks",
                  "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"}
EVENT_ONLY |= HOST_TIER_ONLY | {"pdserve_kv_prefix_pull_decisions_total"}  # no peer prefix in this stack's run
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label matchers, ranges, grouping clauses,
    strings and function names removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_metric_names_parser():
    assert metric_names(
        'histogram_quantile(0.9, sum by (le, role) (rate(vllm:x_bucket{a="b", c=~"$d"}[$__rate_interval])))'
    ) == {"vllm:x_bucket"}
    assert metric_names('sum(rate(a_total{s!~"2.."}[1m])) / sum without (pod) (b) and on (x) c offset 5m') == {
        "a_total",
        "b",
        "c",
    }
    assert metric_names("count by (role) (up)") == {"up"}  # a name the code does not export is still found


def test_dashboards_are_importable_grafana_json():
    assert set(DASHBOARDS) == {"pd-overview", "workers", "kv-transfer", "router"}
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert len(set(uids)) == len(uids)
    for d in DASHBOARDS.values():
        assert d["title"].startswith("pdserve / ") and d["schemaVersion"] >= 36
        assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "namespace", "modelserving"]
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids) and all(p["targets"] for p in d["panels"])
        cells: set[tuple[int, int]] = set()
        for p in d["panels"]:
            assert p["datasource"]["uid"] == "${datasource}"  # no hard-wired datasource
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not mine & cells, f"{d['title']}: {p['title']} overlaps another panel"
            cells |= mine


def exported_names(text: str) -> set[str]:
    """Sample names on a /metrics page, plus those a declared-but-empty family would have."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names |= {name} if kind != "histogram" else {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


@pytest.fixture(scope="module")
def stack(tiny_checkpoint, tmp_path_factory):
    from e2e.processes import Stack
    from pdserve.cli.stack import StackConfig, free_port

    # Flow control on (it is off by default), so its panels see the queue and its waits.
    config = StackConfig(prefill=1, decode=1, host="127.0.0.1", port=free_port(), device="cpu", kv_transfer="tcp",
                         router_args=("--flow-control-max-inflight", "64"))
    s = Stack(config, tiny_checkpoint("llama"), "tiny", tmp_path_factory.mktemp("dash-stack"))
    try:
        yield s.start_all()
    finally:
        s.stop_all()


def traffic(stack, n: int = 4) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=stack.url("router") + "/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(n):
        chunks = client.completions.create(model="tiny", prompt=f"Dashboards are {i} times", max_tokens=8,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.slow
def test_every_dashboard_metric_is_exported(stack):
    traffic(stack)
    exported: set[str] = set()
    for name in stack.children:
        exported |= exported_names(httpx.get(stack.url(name) + "/metrics", timeout=10).text)
    used = {n for _, e in ALL_EXPRS for n in metric_names(e)}
    assert used, "no metric names found in the dashboards"
    assert used - HOST_TIER_ONLY <= exported, f"dashboard metrics nobody exports: {sorted(used - exported)}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Prometheus (apt-get install prometheus)")
def test_every_dashboard_query_evaluates_on_real_prometheus(stack, tmp_path):
    port = free_port()
    # The labels the chart's PodMonitor relabels from pod labels, set here per static target.
    targets = [{"targets": [stack.url(n).removeprefix("http://")],
                "labels": {"namespace": "local", "modelserving": "tiny", "role": c.role, "pod": n}}
               for n, c in stack.children.items()]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "pdserve", "static_configs": targets}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 60
        while True:  # every target scraped at least twice (rate needs two samples)
            try:
                up = httpx.get(f"{api}/query", params={"query": "count_over_time(up[1m]) >= 3"}, timeout=2).json()
                if len(up["data"]["result"]) == len(targets):
                    break
            except (httpx.HTTPError, ValueError, KeyError):  # not up yet, or still starting ("Service Unavailable")
                pass
            assert prom.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[
                -2000:
            ]
            time.sleep(0.5)
        traffic(stack, n=3)
        # Until a scrape after the traffic is in (every second, later on a busy machine): the
        # queries are evaluated again until they see data, within a bound, not after a fixed sleep.
        deadline = time.monotonic() + 60
        while True:
            empty, failed = [], []
            for key, expr in ALL_EXPRS:
                q = expr.replace("$__rate_interval", "1m").replace("$namespace", ".*").replace("$modelserving", ".*")
                body = httpx.get(f"{api}/query", params={"query": q}, timeout=10).json()
                if body["status"] != "success":
                    failed.append((key, expr, body.get("error")))
                elif not body["data"]["result"]:
                    empty.append((key, expr))
            unexpected = [(k, e) for k, e in empty if not (metric_names(e) & EVENT_ONLY or 'status!~"2.."' in e)]
            if failed or (not unexpected and len(empty) < len(ALL_EXPRS) // 4) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not failed, failed
        assert not unexpected, f"queries without data on a serving stack: {unexpected}"
        assert len(empty) < len(ALL_EXPRS) // 4  # most queries see real data
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()
