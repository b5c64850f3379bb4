"""Each component's flags are generated from its one frozen config (pdserve.protocol.flags):
every field has exactly one flag, the parser holds no default of its own (a default is written
once, in the dataclass, and `--help` prints that value), the flags that the operator, `pdserve
up`, the charts and the docs use still parse, and a bad value exits 2 naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys

import pytest

from pdserve.cli import launcher
from pdserve.cli.main import main
from pdserve.cli.stack import StackConfig
from pdserve.protocol.flags import ConfigError, add_flags, flag, flag_name, from_flags, given, no_flag, spec_of
from pdserve.router import main as router_main
from pdserve.router.config import RouterConfig
from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.server import main as worker_main
from pdserve.worker.server.config import ServerConfig

COMPONENTS = {
    "worker": (worker_main.add_arguments, (EngineConfig, ServerConfig)),
    "router": (router_main.add_arguments, (RouterConfig,)),
    "up": (launcher.add_arguments, (StackConfig,)),
}


def parser_of(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"pdserve {name}")
    COMPONENTS[name][0](p)
    return p


def help_entries(name: str, capsys, monkeypatch) -> dict[str, str]:
    """option string -> its entry in `pdserve NAME --help`, on one line (a wide terminal, so help
    text does not wrap; a long option's help starts on the next line, further indented)."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    entries, options = {}, []
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):  # "  --x METAVAR  help", "  --x, --no-x  help" or a long "  --x METAVAR"
            invocation = line.strip().split("  ")[0]
            options = re.findall(r"(?:^|, )(-[-\w]+)", invocation)
            for opt in options:
                entries[opt] = line.strip()
        elif line.startswith("    ") and options:
            for opt in options:
                entries[opt] += " " + line.strip()
        else:
            options = []
    return entries


@pytest.mark.parametrize("name", COMPONENTS)
def test_every_field_has_exactly_one_flag(name):
    parser = parser_of(name)
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).append(action)
    for cls in COMPONENTS[name][1]:
        for f in dataclasses.fields(cls):
            if spec_of(f).not_a_flag:
                assert f.name not in by_dest, f"{cls.__name__}.{f.name} is marked no_flag but has a flag"
                continue
            actions = by_dest.get(f.name, [])
            assert len(actions) == 1, f"{cls.__name__}.{f.name}: {len(actions)} flags"
            assert flag_name(f) in actions[0].option_strings
            # The parser holds no default: a field left off the command line is the dataclass's.
            assert actions[0].default is argparse.SUPPRESS, f"{flag_name(f)} has a default of its own"


@pytest.mark.parametrize("name", COMPONENTS)
def test_help_prints_each_default_from_the_dataclass(name, capsys, monkeypatch):
    entries = help_entries(name, capsys, monkeypatch)
    for cls in COMPONENTS[name][1]:
        for f in dataclasses.fields(cls):
            if spec_of(f).not_a_flag:
                continue
            line = entries[flag_name(f)]
            if spec_of(f).show is not None:  # a default written as the flag takes it (JSON, say)
                shown = spec_of(f).show(f.default)
            elif isinstance(f.default, bool):
                shown = flag_name(f) if f.default else "--no-" + flag_name(f)[2:]
            elif f.default is None or f.default in ("", ()):
                shown = spec_of(f).unset or "none"  # what an absent value means, said in words
            else:
                shown = str(f.default)
            assert line.endswith(f"(default: {shown})"), (flag_name(f), line)


@pytest.mark.parametrize("name", COMPONENTS)
def test_an_empty_command_line_sets_no_field(name):
    args = parser_of(name).parse_args([])
    for cls in COMPONENTS[name][1]:
        assert given(cls, args) == {}


def test_worker_flags_round_trip():
    args = parser_of("worker").parse_args([
        "--model", "/m", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
        "--enforce-eager", "--role", "decode", "--kv-transfer", "tcp", "--kv-peer-allow", "10.0.0.0/8", "peer",
        "--kv-pin-ttl", "5", "--host", "127.0.0.2", "--api-key", "a", "--api-key", "b", "--shutdown-grace", "3"])
    engine, server = worker_main.configs_from_args(
        args, environ={"PDSERVE_API_KEYS": "c", "PDSERVE_KV_SECRET": "s" * 16}
    )
    assert engine == EngineConfig(model="/m", max_num_seqs=8, gpu_memory_utilization=0.5, enable_prefix_caching=False,
                                  enforce_eager=True, role="decode", kv_transfer="tcp", kv_pin_ttl=5.0,
                                  kv_peer_allow=("10.0.0.0/8", "peer"), kv_bind_host="127.0.0.2", kv_secret="s" * 16)
    assert server == ServerConfig(host="127.0.0.2", api_keys=("a", "b", "c"), shutdown_grace_s=3.0)
    # Without --host, the KV side channel listens where HTTP does by default: the dataclass's host.
    engine, server = worker_main.configs_from_args(parser_of("worker").parse_args([]), environ={})
    assert engine.kv_bind_host == server.host == ServerConfig().host and engine.kv_secret is None


def test_router_policy_shorthand_and_env():
    parse = parser_of("router").parse_args
    c = router_main.config_from_args(parse(["--decode", "http://d:1", "--policy", "round-robin"]), environ={})
    assert (c.prefill_policy, c.decode_policy) == ("round-robin", "round-robin")
    c = router_main.config_from_args(parse(["--decode", "http://d:1", "--policy", "round-robin",
                                            "--decode-policy", "least-loaded"]), environ={})
    assert (c.prefill_policy, c.decode_policy) == ("round-robin", "least-loaded")
    c = router_main.config_from_args(parse(["--decode", "http://d:1", "--prefill", "http://p:1", "--api-key", "k"]),
                                     environ={"PDSERVE_API_KEYS": "e", "PDSERVE_WORKER_API_KEY": "w"})
    assert c.prefill_urls == ("http://p:1",) and c.api_keys == ("k", "e") and c.worker_api_key == "w"
    assert (c.prefill_policy, c.decode_policy) == (RouterConfig.prefill_policy, RouterConfig.decode_policy)


def test_cors_flags_take_json_lists_as_vllms_do(capsys, monkeypatch):
    """vLLM's spelling: a JSON list per flag; defaults ["*"] and no credentials, on both components."""
    assert help_entries("router", capsys, monkeypatch)["--allowed-origins"].endswith('(default: ["*"])')
    argv = ["--allowed-origins", '["https://a.example", "https://b.example"]', "--allowed-methods", '["POST"]',
            "--allow-credentials"]
    _, server = worker_main.configs_from_args(parser_of("worker").parse_args(argv), environ={})
    router = router_main.config_from_args(parser_of("router").parse_args(["--decode", "http://d:1", *argv]), environ={})
    for c in (server, router):
        assert c.allowed_origins == ("https://a.example", "https://b.example") and c.allowed_methods == ("POST",)
        assert c.allowed_headers == ("*",) and c.allow_credentials is True
    assert (ServerConfig().allowed_origins, ServerConfig().allow_credentials) == (("*",), False)


def test_router_ejection_cap_is_explicit():
    """The longest ejection is --eject-backoff-max: unset, it is 30 s or --eject-backoff if that
    is longer (what --help says); set below --eject-backoff, it is an error naming it."""
    assert RouterConfig(decode_urls=("http://d:1",)).eject_backoff_max_s == 30.0
    assert RouterConfig(decode_urls=("http://d:1",), eject_backoff_s=60.0).eject_backoff_max_s == 60.0
    assert RouterConfig(decode_urls=("http://d:1",), eject_backoff_max_s=5.0).eject_backoff_max_s == 5.0
    with pytest.raises(ConfigError, match="--eject-backoff-max: must be >= --eject-backoff"):
        RouterConfig(decode_urls=("http://d:1",), eject_backoff_s=10.0, eject_backoff_max_s=5.0)


def test_flags_others_build_still_parse():
    """Command lines as the operator, `pdserve up` and the docs write them."""
    from pdserve.cli.stack import plan

    for child in plan(StackConfig(kv_transfer="tcp", worker_args=("--max-model-len", "64")), "/m", "tiny", gpus=[]):
        name = "router" if child.role == "router" else "worker"
        rest = list(child.argv[child.argv.index(name) + 1:])
        args = parser_of(name).parse_args(rest)
        if name == "worker":
            assert worker_main.configs_from_args(args, environ={})[0].max_model_len == 64
        else:
            assert len(router_main.config_from_args(args, environ={}).decode_urls) == 1
    args = parser_of("up").parse_args(["--worker-args=--max-model-len 2048", "--router-args", "--decode-policy x"])
    c = from_flags(StackConfig, args)
    assert c.worker_args == ("--max-model-len", "2048") and c.router_args == ("--decode-policy", "x")


def test_up_decode_workers_pull_only_from_the_stacks_prefill_kv_ports():
    """Issue 23 items 1 and 3: `pdserve up` allows each decode worker exactly its prefill
    workers' KV ports on loopback (every TP rank's), and with --prefill 0 starts plain workers
    (no KV side channel, no peers to name), which the worker's own checks accept."""
    from pdserve.cli.stack import plan

    def parsed(child):
        rest = list(child.argv[child.argv.index("worker") + 1:])
        return worker_main.configs_from_args(parser_of("worker").parse_args(rest), environ={})[0]

    for tp, span in ((1, 0), (2, 1)):
        children = plan(StackConfig(prefill=2, decode=2, kv_transfer="tcp",
                                    worker_args=("--tensor-parallel-size", str(tp))), "/m", "tiny", gpus=[])
        workers = [c for c in children if c.role != "router"]
        ports = [c.kv_port for c in workers if c.role == "prefill"]
        want = tuple(f"127.0.0.1:{p}" if not span else f"127.0.0.1:{p}-{p + span}" for p in ports)
        for c in workers:
            config = parsed(c)
            assert config.kv_peer_allow == (want if c.role == "decode" else ())
            assert config.kv_listen_host == "127.0.0.1"
    for c in plan(StackConfig(prefill=0, decode=2, kv_transfer="tcp"), "/m", "tiny", gpus=[]):
        if c.role == "decode":
            config = parsed(c)
            assert config.role == "both" and config.kv_transfer is None and c.kv_port is None


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["worker", "--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
        (["worker", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        (["worker", "--load-format", "safetensors"], "argument --load-format: invalid choice: 'safetensors'"),
        (["worker", "--kv-pin-ttl", "0"], "--kv-pin-ttl: must be positive seconds"),
        (["worker", "--chat-template-timeout", "0"], "--chat-template-timeout: must be > 0 seconds"),
        (["router", "--decode", "http://d:1", "--keep-alive", "0"], "--keep-alive: must be > 0 seconds"),
        (
            ["router", "--decode", "http://d:1", "--eject-backoff", "5", "--eject-backoff-max", "1"],
            "--eject-backoff-max:",
        ),
        (["router", "--decode", "http://d:1", "--max-retries", "-1"], "--max-retries: must be >= 0"),
        (["up", "--shutdown-timeout", "0"], "--shutdown-timeout: must be > 0 seconds"),
        (
            ["router", "--decode", "http://d:1", "--allowed-origins", "*"],
            "argument --allowed-origins: expected a JSON list",
        ),
        (["worker", "--allowed-headers", '{"a": 1}'], "argument --allowed-headers: expected a JSON list"),
        (["up", "--kv-transfer", "rdma"], "argument --kv-transfer: invalid choice: 'rdma'"),
        (
            ["router", "--decode", "http://d:1", "--max-request-sequences", "0"],
            "--max-request-sequences: must be an integer >= 1",
        ),
        (["worker", "--max-stop-chars", "0"], "--max-stop-chars: must be an integer >= 1"),
        (
            ["router", "--decode", "http://d:1", "--max-request-id-chars", "0"],
            "--max-request-id-chars: must be an integer >= 1",
        ),
    ],
)
def test_bad_value_exits_2_naming_the_flag(argv, message):
    r = _cli(*argv)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_generator_rules():
    """The generator on a small config of its own: names, kinds of flag, parse, no_flag."""
    @dataclasses.dataclass(frozen=True)
    class Demo:
        max_items: int = flag(3, "items, 100% of them")
        wait_s: float = 1.5
        verbose: bool = flag(False, "talk")
        peers: tuple[str, ...] = flag((), "peers", unset="nobody")
        keys: tuple[str, ...] = flag((), "a key", name="--key", repeat=True)
        words: tuple[str, ...] = flag((), "split", parse=str.split)
        mode: str | None = flag(None, "mode", choices=("a", "b"), unset="automatic")
        derived: str | None = no_flag(None, "set by code")

    p = argparse.ArgumentParser()
    add_flags(p, Demo)
    args = p.parse_args(["--max-items", "4", "--wait", "2", "--verbose", "--peers", "x", "y", "--key", "k1",
                         "--key", "k2", "--words", "a b", "--mode", "b"])
    assert from_flags(Demo, args) == Demo(4, 2.0, True, ("x", "y"), ("k1", "k2"), ("a", "b"), "b")
    assert from_flags(Demo, p.parse_args(["--no-verbose"]), derived="d") == Demo(derived="d")
    assert "--derived" not in p.format_help() and "100% of them (default: 3)" in p.format_help()

    @dataclasses.dataclass(frozen=True)
    class Unexplained:
        x: int | None = None

    with pytest.raises(TypeError, match="x: a None default needs flag"):
        add_flags(argparse.ArgumentParser(), Unexplained)
