import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert len(blocks) >= 2, "README must show the two set-up commands first"
    test_command = blocks[1].strip()
    assert "torch==2.13.0" in test_command and "pytest" in test_command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci


def _pdserve(*args):
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args], capture_output=True, text=True, timeout=60)


def test_cli_lists_subcommands():
    r = _pdserve("--help")
    assert r.returncode == 0
    for name in ("worker", "router", "operator", "up", "bench"):
        assert name in r.stdout


def test_cli_unknown_subcommand_names_it():
    r = _pdserve("frobnicate")
    assert r.returncode == 2
    assert "frobnicate" in r.stderr


def test_up_turns_on_tool_calls_for_the_default_model_only():
    """The quick start's SmolLM2 gets vLLM's tool flags (its hermes format), so bind_tools and
    tool_choice work against `pdserve up` as is; a model of the user's gets none; a parser named
    in --worker-args wins. Each worker command line still parses."""
    from pdserve.cli.stack import StackConfig, plan
    from pdserve.worker.server.main import add_arguments, configs_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def worker_configs(config, default_model):
        for child in plan(config, "/m", "m", gpus=[], default_model=default_model):
            if child.role != "router":
                argv = list(child.argv)
                yield configs_from_args(parser.parse_args(argv[argv.index("worker") + 1:]), environ={})[1]

    for server in worker_configs(StackConfig(kv_transfer="tcp"), True):
        assert (server.tool_call_parser, server.enable_auto_tool_choice) == ("hermes", True)
    for server in worker_configs(StackConfig(kv_transfer="tcp"), False):
        assert (server.tool_call_parser, server.enable_auto_tool_choice) == (None, False)
    mine = StackConfig(kv_transfer="tcp", worker_args=("--tool-call-parser", "llama3_json"))
    for server in worker_configs(mine, True):
        assert (server.tool_call_parser, server.enable_auto_tool_choice) == ("llama3_json", False)


def test_the_stack_nices_nixl_progress_threads_unless_told(monkeypatch):
    """`pdserve up`'s workers share the host's cores with NIXL's spinning progress threads: each
    worker gets ENV_NIXL_PROGRESS_NICE=19, unless the environment already names a value (which
    the launcher then passes on as it is)."""
    from pdserve.cli.stack import StackConfig, plan
    from pdserve.protocol.contract import ENV_NIXL_PROGRESS_NICE

    monkeypatch.delenv(ENV_NIXL_PROGRESS_NICE, raising=False)
    children = plan(StackConfig(), "/m", "m", gpus=[])
    workers = [c for c in children if c.role != "router"]
    assert len(workers) == 2 and all(c.env[ENV_NIXL_PROGRESS_NICE] == "19" for c in workers)
    monkeypatch.setenv(ENV_NIXL_PROGRESS_NICE, "5")
    assert all(ENV_NIXL_PROGRESS_NICE not in c.env for c in plan(StackConfig(), "/m", "m", gpus=[]))


def test_up_serves_the_default_model_in_bf16_where_the_cpu_computes_it(monkeypatch, tmp_path):
    """On a CPU with native bf16 the default model's workers run in bfloat16 (half the bytes
    per step); a CPU without it, a model of the user's, a --dtype in --worker-args, or GPU
    workers keep what the worker would pick. Each worker command line still parses."""
    from pdserve.cli import stack
    from pdserve.cli.stack import StackConfig, plan
    from pdserve.worker.server.main import add_arguments, configs_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def dtypes(config, default_model, gpus=()):
        out = set()
        for child in plan(config, "/m", "m", gpus=list(gpus), default_model=default_model):
            if child.role != "router":
                argv = list(child.argv)
                out.add(configs_from_args(parser.parse_args(argv[argv.index("worker") + 1:]), environ={})[0].dtype)
        return out

    detect = stack.cpu_has_native_bf16
    monkeypatch.setattr(stack, "cpu_has_native_bf16", lambda: True)
    assert dtypes(StackConfig(kv_transfer="tcp"), True) == {"bfloat16"}
    assert dtypes(StackConfig(kv_transfer="tcp"), False) == {"auto"}
    assert dtypes(StackConfig(kv_transfer="tcp", worker_args=("--dtype", "float32")), True) == {"float32"}
    assert dtypes(StackConfig(kv_transfer="tcp"), True, gpus=["0"]) == {"auto"}
    monkeypatch.setattr(stack, "cpu_has_native_bf16", lambda: False)
    assert dtypes(StackConfig(kv_transfer="tcp"), True) == {"auto"}

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert not detect(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert detect(str(info))
    assert not detect(str(tmp_path / "missing"))


def test_workers_sharing_a_gpu_are_the_stacks_mps_clients(tmp_path):
    """Only workers on a GPU another worker also has get the daemon's pipes; with no daemon (CPU,
    --gpu-sharing timeslice, no MPS) none do, and the launcher's log line says how many are."""
    from pdserve.cli.mps import MpsDaemon
    from pdserve.cli.stack import StackConfig, describe_devices, plan, workers_per_gpu

    mps = MpsDaemon("/bin/true", tmp_path / "mps-pipe", tmp_path / "mps-log")
    config = StackConfig(prefill=2, decode=1)
    assert workers_per_gpu(config, ["0", "1"]) == {"0": 2, "1": 1}
    workers = [c for c in plan(config, "/m", "m", gpus=["0", "1"], mps=mps) if c.role != "router"]
    clients = {c.name: c.env.get("CUDA_MPS_PIPE_DIRECTORY") for c in workers}
    assert clients == {"prefill-0": str(mps.pipe_dir), "prefill-1": None, "decode-0": str(mps.pipe_dir)}
    assert all(c.env.get("CUDA_MPS_LOG_DIRECTORY") == str(mps.log_dir) for c in workers if clients[c.name])
    assert describe_devices(workers) == "cuda (GPUs 0, 1, round-robin; 2 worker(s) on MPS)"
    alone = [c for c in plan(config, "/m", "m", gpus=["0", "1", "2"], mps=mps) if c.role != "router"]
    assert not any("CUDA_MPS_PIPE_DIRECTORY" in c.env for c in alone)  # one worker a GPU: nothing to share
    assert not any("CUDA_MPS_PIPE_DIRECTORY" in c.env for c in plan(config, "/m", "m", gpus=["0"]))


def test_the_stacks_mps_daemon_starts_and_quits_in_its_own_folders(tmp_path, monkeypatch):
    """start_mps runs `nvidia-cuda-mps-control -d` with its pipe and log folders under the stack's
    log folder (never a host-wide daemon's), stop_mps sends it `quit`. MPS needs an NVIDIA GPU:
    here a stand-in control binary on PATH records how it was called."""
    import io
    import os
    import stat

    from pdserve.cli import mps
    from pdserve.cli.mps import MpsUnavailable, start_mps, stop_mps

    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text('#!/bin/sh\necho "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY '
                       'stdin=$(cat)" >> ' + str(calls) + '\n'
                       '[ -z "$MPS_FAIL" ] || { echo "cannot start" >&2; exit 1; }\n')
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run_dir = tmp_path / "logs"
    real_probe = mps.probe_client
    monkeypatch.setattr(mps, "probe_client", lambda daemon, gpu: None)  # a client needs the GPU too
    daemon = start_mps(run_dir, "0")
    assert daemon.pipe_dir == run_dir / "mps-pipe" and daemon.pipe_dir.is_dir() and daemon.log_dir.is_dir()
    assert stop_mps(daemon) is None
    started, quit_ = calls.read_text().splitlines()[:2]
    assert started.startswith(f"args=-d pipe={run_dir / 'mps-pipe'} log={run_dir / 'mps-log'}")
    assert quit_ == f"args= pipe={run_dir / 'mps-pipe'} log={run_dir / 'mps-log'} stdin=quit"
    # The launcher: a daemon only where a GPU is shared and sharing is not `timeslice`; `auto`
    # goes on time-sliced when MPS will not start, `mps` stops with the flag named.
    from pdserve.cli.launcher import Launcher
    from pdserve.cli.stack import StackConfig
    from pdserve.protocol.flags import ConfigError

    def sharing(mode, gpus, out=None):
        return Launcher(StackConfig(gpu_sharing=mode), out=out or io.StringIO())._gpu_sharing(gpus, run_dir)

    assert sharing("auto", ["0"]) is not None
    assert sharing("auto", ["0", "1"]) is None and sharing("timeslice", ["0"]) is None
    # A daemon whose client cannot start is stopped again (the real probe: no GPU here).
    before = len(calls.read_text().splitlines())
    with pytest.raises(MpsUnavailable, match="a client of the MPS daemon could not start: cuInit returned 100"):
        start_mps(run_dir, "0", probe=lambda daemon, gpu: "cuInit returned 100")
    assert [ln.split()[0] for ln in calls.read_text().splitlines()[before:]] == ["args=-d", "args="]
    if not Path("/dev/nvidia0").exists():  # the real probe, where there is no driver: it says so
        assert "libcuda" in real_probe(daemon, "0")
    monkeypatch.setenv("MPS_FAIL", "1")
    with pytest.raises(MpsUnavailable, match="cannot start"):
        start_mps(run_dir, "0")
    with pytest.raises(MpsUnavailable, match="not on PATH"):
        start_mps(run_dir, "0", which=lambda name: None)
    said = io.StringIO()
    assert sharing("auto", ["0"], said) is None
    assert "time-sliced (no MPS" in said.getvalue()
    with pytest.raises(ConfigError, match="--gpu-sharing"):
        sharing("mps", ["0"])


def test_gpu_sharing_flag_is_checked():
    from pdserve.cli.stack import StackConfig
    from pdserve.protocol.flags import ConfigError

    with pytest.raises(ConfigError, match="--gpu-sharing"):
        StackConfig(gpu_sharing="always")
    assert StackConfig(gpu_sharing="mps", device="cpu").gpu_sharing == "mps"  # no GPU: nothing to share
