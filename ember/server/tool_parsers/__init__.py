"""Tool-call parsers by name, as `--tool-call-parser` picks them."""

from __future__ import annotations

from ember.server.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from ember.server.tool_parsers.hermes import HermesToolParser
from ember.server.tool_parsers.kimi_k2 import KimiK2ToolParser

_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "kimi_k2": KimiK2ToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; known: {known}") from None


__all__ = [
    "ExtractedToolCalls",
    "HermesToolParser",
    "KimiK2ToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
]
