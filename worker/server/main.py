"""`pdserve worker`: one engine behind the OpenAI-compatible HTTP server.

Shutdown on SIGTERM (what Kubernetes sends): uvicorn stops accepting connections, in-flight
requests run for `--shutdown-grace` seconds, whatever is left is aborted (its stream still ends
properly, finish_reason "abort", then [DONE]), the engine stops, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from pdserve.protocol.contract import ENV_API_KEYS
from pdserve.protocol.flags import ConfigError, add_flags
from pdserve.protocol.http_limits import ClientLimits
from pdserve.worker.config.engine import EngineConfig, is_loopback
from pdserve.worker.server.config import ServerConfig

log = logging.getLogger("pdserve.worker.server")

# After the grace period, streams end within a few steps; this bounds uvicorn's own wait.
_UVICORN_SLACK_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, EngineConfig, "engine")
    add_flags(parser, ServerConfig, "server")


def served_model_name(config: EngineConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    if config.model:
        return config.model
    from pdserve.worker.models.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def configs_from_args(args: argparse.Namespace, environ=os.environ) -> tuple[EngineConfig, ServerConfig]:
    """Both configs of the command line; the KV side channel listens where HTTP does (--host)
    unless --kv-host says otherwise."""
    server_config = ServerConfig.from_cli_args(args, environ.get(ENV_API_KEYS))
    return EngineConfig.from_cli_args(args, environ, bind_host=server_config.host), server_config


def check_harmony_tokenizer(server_config: ServerConfig, model: str | None) -> None:
    """--reasoning-parser openai_gptoss / --tool-call-parser openai read harmony's special tokens:
    a model whose tokenizer has none is refused before its weights load (ConfigError: exit 2)."""
    flag = server_config.harmony_flag
    if flag is None:
        return
    from transformers import AutoTokenizer

    from pdserve.worker.models.loader import resolve_model_path
    from pdserve.worker.server.tool_parsers.harmony import missing_tokens

    path = resolve_model_path(model)
    if missing := missing_tokens(AutoTokenizer.from_pretrained(path)):
        value = server_config.reasoning_parser if flag == "--reasoning-parser" else server_config.tool_call_parser
        raise ConfigError(flag, f"{value} reads gpt-oss's harmony format, but the tokenizer of {model or path} "
                                f"lacks its special tokens ({', '.join(missing)}); serve a gpt-oss model or "
                                "drop the flag")


def run(args: argparse.Namespace) -> int:
    # A ConfigError (a bad flag) reaches pdserve.cli.main, which names the flag and exits 2.
    engine_config, server_config = configs_from_args(args)
    logging.basicConfig(level=server_config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_harmony_tokenizer(server_config, engine_config.model)
    if not server_config.api_keys and not is_loopback(server_config.host):
        log.warning("listening on %s without --api-key (or $%s): anyone who reaches this port may send "
                    "requests, kv_transfer_params included, and read /metrics and /debug/kv", server_config.host,
                    ENV_API_KEYS)

    import uvicorn

    from pdserve.worker.engine.async_engine import AsyncEngine
    from pdserve.worker.server.app import build_app

    fatal: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(e: BaseException) -> None:
        fatal.append(e)
        if server is not None:
            server.should_exit = True

    app = build_app(server_config, served_model_name(engine_config),
                    lambda: AsyncEngine.from_config(engine_config), on_fatal, engine_config.model, freeze_heap=True)
    state = app.state.worker
    # Keep-alive stays at uvicorn's 5 s: below the router's pool keep-alive would drop
    # connections the router still thinks are open, above it only holds idle sockets.
    limits = ClientLimits(server_config.header_timeout_s, 5.0, server_config.max_connections)
    uv_config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                               log_level=server_config.log_level, access_log=server_config.log_level == "debug",
                               timeout_graceful_shutdown=server_config.shutdown_grace_s + _UVICORN_SLACK_S,
                               **limits.uvicorn_options())

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit and state.engine is not None:
                # A signal handler runs on the loop's thread, between two callbacks.
                loop = asyncio.get_running_loop()
                loop.call_soon_threadsafe(state.begin_drain, server_config.shutdown_grace_s)
            super().handle_exit(sig, frame)

    server = Server(uv_config)
    # uvicorn re-raises a caught signal after shutting down, to die "as expected"; a graceful
    # shutdown should exit 0, so the handlers it restores ignore that replay.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if fatal:
        log.error("exiting: the engine could not be loaded (%s)", fatal[0])
        return 1
    return 0
