"""`pdserve up` itself: the child plan (GPU round-robin, ports), bad flags, a busy port, a child
that fails to start, a child killed while serving, and SIGTERM. Real processes, tiny checkpoint."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from tests.net import free_port
from e2e.processes import UpProcess, eventually, pid_alive
from pdserve.cli.stack import StackConfig, plan, visible_gpus


# Dispatched with the slow modules, before the quick ones (tests/conftest.py): `pdserve up` stacks, ~15 s each to start.
pytestmark = pytest.mark.slow


def up_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "up", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_assigns_gpus_round_robin_and_distinct_ports():
    config = StackConfig(prefill=2, decode=2, port=9000, kv_transfer="tcp", worker_args=("--max-model-len", "512"))
    children = plan(config, "/models/m", "m", gpus=["0", "1", "2"])
    assert [c.name for c in children] == ["prefill-0", "prefill-1", "decode-0", "decode-1", "router"]
    assert [c.env.get("CUDA_VISIBLE_DEVICES") for c in children] == ["0", "1", "2", "0", None]
    # GPU 0 carries two workers: each gets half the memory; the others keep the default.
    assert "0.45" in children[0].argv and "--gpu-memory-utilization" not in children[1].argv
    workers = children[:4]
    ports = [c.url.rsplit(":", 1)[1] for c in workers] + [str(c.kv_port) for c in workers]
    assert len(set(ports)) == 8
    for c in workers:
        assert c.argv[-2:] == ("--max-model-len", "512") and "--kv-transfer" in c.argv
    router = children[-1].argv
    assert router.count("--prefill") == 2 and router.count("--decode") == 2 and "9000" in router
    cpu = plan(StackConfig(device="cpu", kv_transfer="tcp"), "/m", "m", gpus=[])
    assert all("CUDA_VISIBLE_DEVICES" not in c.env for c in cpu) and "cpu" in cpu[0].argv


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


@pytest.mark.parametrize("args,flag", [
    (["--prefill", "-1"], "--prefill"),
    (["--decode", "0"], "--decode"),
    (["--device", "tpu"], "--device"),
    (["--kv-transfer", "rdma"], "--kv-transfer"),
    (["--port", "70000"], "--port"),
    (["--worker-args", "'unclosed quote"], "--worker-args"),
    (["--prefill", "two"], "--prefill"),
    (["--ready-timeout", "0"], "--ready-timeout"),
])
def test_bad_flag_is_named(args, flag):
    r = up_cli(*args)
    assert r.returncode == 2
    assert flag in r.stderr and "Traceback" not in r.stderr


def test_busy_port_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = up_cli("--host", "127.0.0.1", "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "--port" in r.stderr and "already in use" in r.stderr


def test_child_failing_at_start_exits_nonzero_with_its_log(tiny_checkpoint):
    r = up_cli("--model", str(tiny_checkpoint("llama")), "--port", str(free_port()), "--device", "cpu",
               "--kv-transfer", "tcp", "--worker-args=--max-num-seqs 0")
    assert r.returncode == 1
    assert "exited with code 2" in r.stdout and "---- last lines of" in r.stdout
    assert "--max-num-seqs: must be at least 1" in r.stdout  # the child's own message, from its log
    assert "stopped:" in r.stdout


@pytest.fixture
def tiny_up(tiny_checkpoint, tmp_path):
    up = UpProcess("--model", str(tiny_checkpoint("llama")), "--served-model-name", "tiny", "--host", "127.0.0.1",
                   "--port", str(free_port()), "--device", "cpu", "--kv-transfer", "tcp", "--log-dir",
                   str(tmp_path / "children"), "--worker-args=--kv-cache-memory 16777216", log_path=tmp_path / "up.log")
    up.start()
    try:
        yield up.wait_ready()
    finally:
        up.stop(signal.SIGKILL)
        up.kill_leftovers()


def test_killed_child_stops_the_stack(tiny_up):
    pids = {name: pid for name, (pid, _) in tiny_up.children.items()}
    subprocess.run(["kill", "-9", str(pids["decode-0"])], check=True)
    assert tiny_up.wait_exit() == 1
    out = tiny_up.output()
    assert f"decode-0 (pid {pids['decode-0']}) exited with code -9" in out
    assert "---- last lines of" in out and "decode-0.log" in out
    assert not [n for n, p in pids.items() if pid_alive(p)], "orphaned children"


def test_sigterm_stops_every_child(tiny_up):
    pids = [pid for pid, _ in tiny_up.children.values()]
    assert tiny_up.stop(signal.SIGTERM) == 0
    assert "SIGTERM: stopping" in tiny_up.output()
    eventually(lambda: not any(pid_alive(p) for p in pids), 5, "every child gone")
