"""`pdserve up` on the default model (SmolLM2-135M-Instruct, CPU), called with the real `openai`
client: chat and completions, streamed and not, the French-capital answer, 32 requests at once,
the banner's own curl and Python examples, no leaked KV blocks, and Ctrl-C stopping every child.

The tests run in file order on one stack; the last one stops it.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.net import free_port
from e2e.processes import UpProcess, eventually, pid_alive
from tests.helpers.metrics import metric_value

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def up(default_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("up")
    stack = UpProcess("--port", str(free_port()), "--host", "127.0.0.1", "--log-dir", str(logs / "children"),
                      "--worker-args=--kv-cache-memory 268435456 --max-model-len 1024", log_path=logs / "up.log")
    stack.start()
    try:
        stack.wait_ready()
        stack.baseline = {name: httpx.get(url + "/debug/kv").json()["num_free_blocks"]
                          for name, (_, url) in stack.children.items() if name != "router"}
        yield stack
    finally:
        stack.stop(signal.SIGINT)
        stack.kill_leftovers()


@pytest.fixture
def client(up):
    return openai.OpenAI(base_url=up.base_url, api_key="none", max_retries=0, timeout=120)


def test_stage_log_and_banner(up):
    out = up.output()
    for stage in ("stage 1/3 model", "stage 2/3 processes", "stage 3/3 health"):
        assert stage in out
    assert set(up.children) == {"prefill-0", "decode-0", "router"}
    assert re.search(r"prefill-0\s+ready \(\d+\.\ds\)", out) and re.search(r"router\s+ready", out)
    assert "kv-transfer nixl" in out or "kv-transfer tcp" in out
    assert up.base_url.endswith("/v1") and f"curl {up.base_url}/chat/completions" in out


def test_banner_examples_run_as_printed(up):
    out = up.output()
    python = re.search(r"python - <<'EOF'\n(.*?)\nEOF", out, re.S).group(1)
    r = subprocess.run([sys.executable, "-"], input=python, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    if shutil.which("curl"):
        curl = re.search(r"  (curl .*?)\n\n", out, re.S).group(1).replace("\\\n", " ")
        r = subprocess.run(["bash", "-c", curl + " --silent --fail-with-body"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Paris" in r.stdout


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_chat_french_capital(client, served_name, stream):
    kw = dict(model=served_name, messages=QUESTION, max_tokens=24, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert finish == ["stop"] and usage.completion_tokens > 0 and usage.prompt_tokens > 0
    else:
        r = client.chat.completions.create(**kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens > 0
    assert text == ANSWER


def test_the_stack_really_disaggregates(up):
    # The chat answers above are right even if every pull failed (decode falls back to local
    # prefill), so check the decode worker pulled KV and never fell back: the stack's secret and
    # loopback allowlist must let its own workers through.
    metrics = httpx.get(up.children["decode-0"][1] + "/metrics").text
    assert metric_value(metrics, "pdserve_kv_transfer_bytes_total") > 0, metrics
    assert metric_value(metrics, "pdserve_kv_transfer_failures_total") == 0
    assert metric_value(metrics, "pdserve_kv_local_prefill_fallbacks_total") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_completions(client, served_name, stream):
    kw = dict(model=served_name, prompt=PROMPT, max_tokens=8, temperature=0)
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        r = client.completions.create(**kw)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert text.startswith(" Paris.")


def test_requests_were_disaggregated(up):
    metrics = httpx.get(up.base_url.removesuffix("/v1") + "/metrics").text
    assert re.search(r'disaggregated="yes"[^\n]*\} [1-9]', metrics), metrics


def test_32_concurrent_requests_all_correct_and_complete(client, served_name):
    def one(i: int) -> tuple[str, str | None]:
        kind = i % 4
        if kind == 0:
            r = client.chat.completions.create(model=served_name, messages=QUESTION, max_tokens=24, temperature=0)
            return r.choices[0].message.content, r.choices[0].finish_reason
        if kind == 1:
            chunks = list(client.chat.completions.create(model=served_name, messages=QUESTION, max_tokens=24,
                                                         temperature=0, stream=True))
            return ("".join(c.choices[0].delta.content or "" for c in chunks),
                    chunks[-1].choices[0].finish_reason)
        if kind == 2:
            r = client.completions.create(model=served_name, prompt=PROMPT, max_tokens=8, temperature=0)
            return r.choices[0].text, r.choices[0].finish_reason
        chunks = list(client.completions.create(model=served_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    for i, (text, finish) in enumerate(results):
        if i % 4 < 2:
            assert (text, finish) == (ANSWER, "stop"), i
        else:
            assert text.startswith(" Paris.") and finish == "length", (i, text)


def test_readme_python_example_runs(up):
    """README's quick-start snippet, pointed at this stack's port, prints the answer."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)\n```", readme, re.S).group(1)
    assert "http://127.0.0.1:8000/v1" in snippet
    snippet = snippet.replace("http://127.0.0.1:8000/v1", up.base_url)
    r = subprocess.run([sys.executable, "-"], input=snippet, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ANSWER


def test_no_kv_blocks_leaked(up):
    def back_to_start():
        for name, (_, url) in up.children.items():
            if name != "router":
                kv = httpx.get(url + "/debug/kv").json()
                if kv["num_free_blocks"] != up.baseline[name] or kv["num_pinned_blocks"] or kv["num_running"]:
                    return False
        return True

    eventually(back_to_start, 30, "free blocks back to their start values, nothing pinned")


def test_ctrl_c_stops_every_child(up):
    pids = [pid for pid, _ in up.children.values()]
    assert all(pid_alive(p) for p in pids)
    assert up.stop(signal.SIGINT) == 0
    out = up.output()
    assert "SIGINT: stopping" in out and "stopped:" in out
    assert not [p for p in pids if pid_alive(p)], "orphaned children"
