"""`pdserve router`: the command line, turned into one RouterConfig, then uvicorn."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from pdserve.protocol.http_limits import ClientLimits
from pdserve.router.config import RouterConfig, keys_from_env, worker_key_from_env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill worker (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)")
    p.add_argument("--discovery", choices=("static", "kubernetes"), default="static")
    p.add_argument("--namespace", default="default")
    p.add_argument("--selector", default="", help="label selector of the worker pods, e.g. pdserve.io/modelserving=llama")
    p.add_argument("--discovery-interval", type=float, default=2.0, metavar="SECONDS")
    p.add_argument("--policy", default=None, help="policy for both pools (see --prefill-policy/--decode-policy)")
    p.add_argument("--prefill-policy", default=None, help="default: round-robin, or --policy")
    p.add_argument("--decode-policy", default=None, help="default: least-loaded, or --policy")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accepted client key (repeatable); also from $PDSERVE_API_KEYS, comma-separated")
    p.add_argument("--worker-api-key", default=None, metavar="KEY",
                   help="key sent to workers (started with that --api-key); also $PDSERVE_WORKER_API_KEY; "
                        "default: the first --api-key")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a client's request headers must be complete within this (slowloris)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a client's request body must arrive within this (408 otherwise)")
    p.add_argument("--keep-alive", type=float, default=30.0, metavar="SECONDS", help="idle keep-alive connections close after this")
    p.add_argument("--max-client-connections", type=int, default=4096,
                   help="open client connections past which new requests get 503")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=0,
                   help="shorter prompts (estimated) skip the prefill worker")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (needed by prefix-aware)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--connect-timeout", type=float, default=2.0, metavar="SECONDS")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    p.add_argument("--first-byte-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="wait for a streaming worker's headers (its queueing and prefill included)")
    p.add_argument("--stream-idle-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="longest gap between chunks once a stream has started")
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("--eject-after-failures", type=int, default=3)
    p.add_argument("--eject-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="first ejection period; doubles while the worker keeps failing (max 30 s)")
    p.add_argument("--probe-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--kv-events-port", type=int, default=5557)
    p.add_argument("--kv-events-replay-port", type=int, default=5558)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        host=args.host, port=args.port, prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
        discovery=args.discovery, namespace=args.namespace, selector=args.selector,
        discovery_interval_s=args.discovery_interval,
        prefill_policy=args.prefill_policy or args.policy or "round-robin",
        decode_policy=args.decode_policy or args.policy or "least-loaded",
        api_keys=tuple(args.api_key) + keys_from_env(),
        worker_api_key=args.worker_api_key or worker_key_from_env(),
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, keep_alive_s=args.keep_alive,
        max_client_connections=args.max_client_connections, pd_min_prompt_tokens=args.pd_min_prompt_tokens,
        tokenizer=args.tokenizer, max_body_bytes=args.max_body_bytes, connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout, first_byte_timeout_s=args.first_byte_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        max_retries=args.max_retries, eject_after_failures=args.eject_after_failures, eject_backoff_s=args.eject_backoff,
        eject_backoff_max_s=max(30.0, args.eject_backoff),
        probe_interval_s=args.probe_interval, kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        message = str(e)
        if args.policy and not (args.prefill_policy or args.decode_policy):
            # The value came from --policy: name the flag the user typed.
            message = message.replace("--prefill-policy", "--policy").replace("--decode-policy", "--policy")
        print(f"pdserve router: {message}", file=sys.stderr)
        return 2
    import uvicorn

    from pdserve.router.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = uvicorn.Server(uvicorn.Config(build_app(config), host=config.host, port=config.port,
                                           log_level=args.log_level, access_log=False, loop="auto",
                                           **ClientLimits(config.header_timeout_s, config.keep_alive_s,
                                                          config.max_client_connections).uvicorn_options()))
    # uvicorn re-raises a caught SIGTERM/SIGINT once it has shut down, so the process would die
    # "by the signal" (-15) after a clean drain; the handlers it restores ignore that replay, so
    # a graceful stop exits 0 like the workers do.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0
