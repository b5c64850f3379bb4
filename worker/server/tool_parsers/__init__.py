"""Tool-call parsers by name, as vLLM's `--tool-call-parser` names them."""

from __future__ import annotations

from pdserve.worker.server.tool_parsers.base import Parsed, ToolCallParseError, ToolCallStream, ToolParser
from pdserve.worker.server.tool_parsers.harmony import REASONING_PARSERS, HarmonyParser
from pdserve.worker.server.tool_parsers.hermes import HermesParser
from pdserve.worker.server.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, HarmonyParser)}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(sorted(PARSERS))})") from None


__all__ = ["PARSERS", "REASONING_PARSERS", "Parsed", "ToolCallParseError", "ToolCallStream", "ToolParser", "get_parser"]
