"""`pdserve router`: the command line, turned into one RouterConfig, then uvicorn."""

from __future__ import annotations

import argparse
import logging

from pdserve.protocol.flags import ConfigError, add_flags, from_flags
from pdserve.router.config import RouterConfig, keys_from_env, worker_key_from_env


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, RouterConfig)
    # Not a field: a shorthand for --prefill-policy and --decode-policy together.
    p.add_argument("--policy", default=None, metavar="POLICY",
                   help="policy for both pools, where --prefill-policy/--decode-policy are not given")


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> RouterConfig:
    # --policy fills each pool whose own flag is absent; a bad value there names --policy.
    pools = {
        name: args.policy for name in ("prefill_policy", "decode_policy") if args.policy and name not in vars(args)
    }
    try:
        return from_flags(
            RouterConfig,
            args,
            **pools,
            api_keys=tuple(getattr(args, "api_keys", ())) + keys_from_env(environ),
            worker_api_key=getattr(args, "worker_api_key", None) or worker_key_from_env(environ),
        )
    except ConfigError as e:
        if e.flag.removeprefix("--").replace("-", "_") in pools:
            raise ConfigError("--policy", e.message) from None
        raise


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # a ConfigError reaches pdserve.cli.main: exit 2 naming the flag
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.workers > 1:
        from pdserve.router.processes import run_processes

        return run_processes(config)
    from pdserve.router.server import serve

    serve(config)
    return 0
