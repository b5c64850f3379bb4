"""`pdserve bench NAME [ARGS...]`: runs bench/NAME.py as if it were `python -m pdserve.bench.NAME`."""

from __future__ import annotations

import argparse
import runpy
import sys

BENCHMARKS = {
    "kernels": "pdserve.bench.kernels",
    "kv-transfer": "pdserve.bench.kv_transfer",
    "tcp-kv": "pdserve.bench.tcp_kv",
    "tcp-io": "pdserve.bench.tcp_io",
    "router": "pdserve.bench.router",
    "engine": "pdserve.bench.engine",
    "tp": "pdserve.bench.tp",
    "tp-pd": "pdserve.bench.tp_pd",
    "moe": "pdserve.bench.moe",
    "deepseek": "pdserve.bench.deepseek",
    "serve": "pdserve.bench.serve",
    "plot": "pdserve.bench.plot",
    "serve-ceiling": "pdserve.bench.serve_ceiling",
    "disagg": "pdserve.bench.disagg",
    "handoff": "pdserve.bench.handoff",
    "fp8-kv": "pdserve.bench.fp8_kv",
    "structured": "pdserve.bench.structured",
    "planner-sim": "pdserve.bench.planner_sim",
    "fp8": "pdserve.bench.fp8",
    "fp8-gemv-tune": "pdserve.bench.fp8_gemv_tune",
    "gemv": "pdserve.bench.gemv",
    "step-overlap": "pdserve.bench.step_overlap",
    "pd-async": "pdserve.bench.pd_async",
    "lora": "pdserve.bench.lora",
    "migration": "pdserve.bench.migration",
    "pull-timeline": "pdserve.bench.pull_timeline",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags (see NAME --help)")


def run(args: argparse.Namespace) -> int:
    sys.argv = [f"pdserve bench {args.name}", *args.args]
    try:
        runpy.run_module(BENCHMARKS[args.name], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0
