"""Kimi-K2 tool calls: `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>
functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`, then the section's end."""

from __future__ import annotations

import re

from ember.server.tool_parsers.base import CallHead, OpenCall, ToolParser

_ARGS_BEGIN = "<|tool_call_argument_begin|>"
# The name runs from after the optional `functions.` to the last `:`; the whole is the call's id.
_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>.+):\d+", re.DOTALL)


class KimiK2ToolParser(ToolParser):
    """The markers are special tokens, so the server must keep them when detokenizing. Both the
    plural section markers and the singular ones some checkpoints emit are understood; a call needs
    no section around it. Arguments are the model's own JSON text, stripped of surrounding space."""

    start_tag = "<|tool_call_begin|>"
    end_tag = "<|tool_call_end|>"
    separators = (
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_section_begin|>",
        "<|tool_call_section_end|>",
    )

    def adjust_skip_special_tokens(self) -> bool | None:
        return False

    def _find_end(self, body: str, call: OpenCall) -> int | None:
        end = body.find(self.end_tag, call.searched)
        if end < 0:
            call.searched = max(0, len(body) - len(self.end_tag) + 1)
            return None
        return end

    def _parse_head(self, body: str) -> CallHead | None:
        i = body.find(_ARGS_BEGIN)
        if i < 0:
            return None
        call_id = body[:i].strip()
        m = _CALL_ID.fullmatch(call_id)
        if m is None:
            return None
        return CallHead(name=m["name"], id=call_id, args_start=i + len(_ARGS_BEGIN))

    def _tail_ok(self, body: str, args_end: int) -> bool:
        return not body[args_end:].strip()
