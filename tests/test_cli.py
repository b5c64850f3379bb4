import argparse
import re
import subprocess
import sys
from pathlib import Path

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
