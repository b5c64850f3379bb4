"""The repository's Dockerfile, built and run with podman and runc (issue 28, item 1).

The image is built by .ci/build_image.sh: the same Dockerfile users build, with a Debian base
(mmdebstrap) and the CPU torch wheel as build arguments instead of the CUDA base and PyTorch's
cu130 index, which this machine cannot reach. Every container runs as the pods do
(charts/pdserve and the operator's Deployments): UID 1000, read-only root filesystem, all
capabilities dropped, no privilege escalation. The worker serves a tiny random checkpoint
mounted read-only into the container and answers the real `openai` client; nothing is downloaded.

Skips, with the reason, only where podman cannot run: podman, runc or mmdebstrap not installed
(.ci/run installs them with apt, best effort), or `podman info` failing.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from e2e.containers import build_image, podman_unusable
from tests.net import free_port

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = ROOT / ".ci" / "containers.conf"
ENV = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}
# How the chart's and operator's pods run it (securityContext): the same restrictions here.
AS_A_POD = ["--user", "1000:1000", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


REASON = podman_unusable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow]


def podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, env=ENV, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out


@pytest.fixture(scope="module")
def image() -> str:
    """Builds the image (podman's layer cache makes a rebuild of unchanged layers instant)."""
    t0 = time.monotonic()
    name = build_image()
    print(f"\nbuilt {name} in {time.monotonic() - t0:.0f}s")
    print(podman("images", "--filter", "reference=localhost/pdserve*").stdout)
    print(podman("history", "--format", "{{.Size}}\t{{.CreatedBy}}", name).stdout)
    return name


@pytest.mark.timeout(1800)
def test_help_as_a_pod(image):
    out = podman("run", "--rm", *AS_A_POD, image, "--help")
    for sub in ("worker", "router", "operator"):
        assert sub in out.stdout, out.stdout


def test_operator_help(image):
    out = podman("run", "--rm", *AS_A_POD, image, "operator", "--help")
    assert "usage:" in out.stdout.lower() and "operator" in out.stdout, out.stdout


def test_image_user_and_root_filesystem(image):
    """The image's own USER is the chart's UID; the root really is read-only; no build leftovers."""
    cfg = podman("image", "inspect", "--format", "{{.Config.User}} {{.Config.Entrypoint}}", image).stdout.strip()
    assert cfg.startswith("1000:1000") and "pdserve" in cfg, cfg
    probe = (
        "import os; print(os.getuid(), os.getgid(), os.access('/opt/pdserve', os.W_OK), os.access('/cache', os.W_OK));"
        "open('/opt/pdserve/x', 'w')"
    )
    out = podman("run", "--rm", *AS_A_POD, "--entrypoint", "python3", image, "-c", probe, check=False)
    # uid gid | the venv not writable, /cache (its VOLUME) writable | and the root is read-only
    assert out.stdout.split() == ["1000", "1000", "False", "True"], out.stdout + out.stderr
    assert "Read-only file system" in out.stderr, out.stderr
    # Lean: no pip cache, no apt lists left in any layer's final state (looked at as root).
    leftovers = "import glob; print(glob.glob('/root/.cache/pip/*') + glob.glob('/var/lib/apt/lists/*_Packages*'))"
    out = podman("run", "--rm", "--user", "0", "--read-only", "--entrypoint", "python3", image, "-c", leftovers)
    assert out.stdout.strip() == "[]", out.stdout


def test_image_holds_this_checkouts_source(image):
    """Every package pyproject.toml ships imports in the image, and the image's copy of a module is
    this checkout's (a stale layer cache once kept an older install under new source)."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    probe = ("import hashlib, importlib, inspect, sys\n"
             "for name in sys.argv[1:]: importlib.import_module(name)\n"
             "import pdserve.router.app as m; print(hashlib.sha256(inspect.getsource(m).encode()).hexdigest())")
    out = podman("run", "--rm", *AS_A_POD, "--entrypoint", "python3", image, "-c", probe, *packages)
    here = hashlib.sha256((root / "router" / "app.py").read_bytes()).hexdigest()
    assert out.stdout.strip() == here, "the image's pdserve.router.app is not this checkout's"


@pytest.fixture
def worker_container(image, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    os.chmod(model, 0o755)  # mktemp's 0700 would hide it from UID 1000
    for f in model.iterdir():
        os.chmod(f, 0o644)
    port = free_port()
    name = f"pdserve-test-worker-{os.getpid()}"
    podman("rm", "--force", name, check=False)
    # Host network: the test's client reaches it on loopback, as it reaches workers everywhere else.
    podman("run", "--detach", "--name", name, *AS_A_POD, "--network", "host", "--memory", "2g",
           "--volume", f"{model}:/model:ro", image,
           "worker", "--model", "/model", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--max-model-len", "256")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            if state != "running":
                raise AssertionError(f"worker container {state}:\n{podman('logs', name, check=False).stdout[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"worker not ready in 240s:\n{podman('logs', name, check=False).stdout[-4000:]}")
            time.sleep(0.5)
        yield url, name
    finally:
        podman("stop", "--time", "10", name, check=False)
        podman("rm", "--force", "--volumes", name, check=False)  # and the image's anonymous /cache


@pytest.mark.timeout(600)
def test_worker_answers_a_chat_request(worker_container):
    from openai import OpenAI

    url, name = worker_container
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Say hello."}])
    assert reply.choices[0].message.content, reply
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    # The process that answered is the container's, as UID 1000 (the image's user "pdserve").
    top = podman("top", name, "user", "args").stdout.splitlines()
    assert any(line.split()[0] == "pdserve" and "pdserve worker" in line for line in top[1:]), top
