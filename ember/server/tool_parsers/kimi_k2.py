"""Kimi-K2 tool calls: `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>
functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`, then the section's end."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from ember.server.tool_parsers.base import CallHead, OpenCall, ToolParser, grammar_tag

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

    def forced_call_grammar(
        self,
        name: str | None,
        parallel: bool = True,
        token_id: Callable[[str], int | None] | None = None,
    ) -> str | None:
        """One section of calls (one only for a named function or parallel_tool_calls false),
        each `functions.NAME:IDX` with arguments held to the function's JSON schema in compact
        JSON, the markers named by token id where the tokenizer has them as added tokens."""
        functions = self.forced_functions(name)
        if not functions:
            return None

        def tag(text: str) -> str:
            return grammar_tag(text, token_id)

        heads = []
        for i, f in enumerate(functions):
            schema = {
                **(f.get("parameters") or {"type": "object"}),
                "x-guidance": {"whitespace_flexible": False},
            }
            heads.append(
                f"fn{i}: {json.dumps('functions.' + f['name'] + ':')} /[0-9]{{1,6}}/ "
                f"{tag(_ARGS_BEGIN)} args{i}"
            )
            heads.append(f"args{i}: %json {json.dumps(schema)}")
        calls = "call+" if parallel and name is None else "call"
        alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
        return (
            "\n".join(
                [
                    f"start: {tag(self.separators[0])} {calls} {tag(self.separators[1])}",
                    f"call: {tag(self.start_tag)} ({alternatives}) {tag(self.end_tag)}",
                    *heads,
                ]
            )
            + "\n"
        )

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
