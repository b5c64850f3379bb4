"""The HTTP server's own configuration (the engine's lives in pdserve.worker.config)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.protocol.contract import ENV_API_KEYS, HTTP_PORT, api_keys_from
from pdserve.worker.config import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = HTTP_PORT
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    log_level: str = "info"
    max_request_bytes: int = 16 * 1024 * 1024  # larger bodies get 413 before being read
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long, then are aborted
    # Slow or numerous clients (pdserve.protocol.http_limits): headers complete within
    # header_timeout_s, the body within body_timeout_s (408), at most max_connections open.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 2048
    tool_call_parser: str | None = None  # how generated text becomes tool_calls (tool_parsers/)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools) allowed

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError("--port", f"must be in 0..65535, got {self.port}")
        if any(not k for k in self.api_keys):
            raise ConfigError("--api-key", "must not be empty")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("--log-level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.max_request_bytes < 1024:
            raise ConfigError("--max-request-bytes", f"must be at least 1024, got {self.max_request_bytes}")
        for flag, value in (("--header-timeout", self.header_timeout_s), ("--body-timeout", self.body_timeout_s)):
            if value <= 0:
                raise ConfigError(flag, f"must be > 0 seconds, got {value}")
        if self.max_connections < 1:
            raise ConfigError("--max-connections", f"must be >= 1, got {self.max_connections}")
        if self.shutdown_grace_s < 0:
            raise ConfigError("--shutdown-grace", f"must be >= 0 seconds, got {self.shutdown_grace_s}")
        from pdserve.worker.server.tool_parsers import PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ConfigError("--tool-call-parser", f"must be one of {', '.join(sorted(PARSERS))}, "
                                                    f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice", "needs --tool-call-parser")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("server")
        g.add_argument("--host", default="0.0.0.0")
        g.add_argument("--port", type=int, default=HTTP_PORT)
        g.add_argument("--api-key", action="append", default=[], dest="api_keys",
                       help=f"accepted bearer key (repeatable; also env {ENV_API_KEYS}, comma-separated)")
        g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
        g.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024)
        g.add_argument("--shutdown-grace", type=float, default=30.0, dest="shutdown_grace_s",
                       help="seconds in-flight requests may run after SIGTERM before they are aborted")
        g.add_argument("--header-timeout", type=float, default=10.0, dest="header_timeout_s",
                       help="seconds a client may take to send a request's headers (slowloris)")
        g.add_argument("--body-timeout", type=float, default=60.0, dest="body_timeout_s",
                       help="seconds a client may take to send a request's body (408 after)")
        g.add_argument("--max-connections", type=int, default=2048,
                       help="open connections past which new requests get 503")
        g.add_argument("--tool-call-parser", default=None,
                       help="tool-call format of the model's output: hermes (Qwen2.5/3, Hermes, SmolLM2) "
                            "or llama3_json (Llama 3.1/3.2)")
        g.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto")')

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, env_api_keys: str | None = None) -> "ServerConfig":
        return cls(host=args.host, port=args.port, api_keys=tuple(args.api_keys) + api_keys_from(env_api_keys), log_level=args.log_level,
                   max_request_bytes=args.max_request_bytes, shutdown_grace_s=args.shutdown_grace_s,
                   header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                   max_connections=args.max_connections,
                   tool_call_parser=getattr(args, "tool_call_parser", None),
                   enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False))
