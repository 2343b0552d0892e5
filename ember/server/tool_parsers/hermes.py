"""Hermes tool calls, as Qwen2.5/Qwen3 (and our tiny models' template) write them:
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, once per call."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable

from ember.server.tool_parsers.base import CallHead, OpenCall, ToolParser, grammar_tag, json_object

# The spelling the chat templates produce, which is the one that can stream its arguments; other
# key orders still parse, once the call is complete. Only the first _HEAD_SPAN characters are
# tried, so a head that never completes costs nothing per token.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_HEAD_SPAN = 512
_OPENERS = re.compile(r'["{\[]')
_ALNUM = string.ascii_letters + string.digits


class HermesToolParser(ToolParser):
    """Arguments the model writes as an object are kept as its own text (and streamed); written as
    a JSON string holding an object, they are that string; in a call with the keys in another order,
    they are re-serialized. `</tool_call>` ends a call only outside its JSON, so arguments may
    contain the tag itself (an agent editing this very file)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def forced_call_grammar(
        self,
        name: str | None,
        parallel: bool = True,
        token_id: Callable[[str], int | None] | None = None,
    ) -> str | None:
        functions = self.forced_functions(name)
        if not functions:
            return None
        call_schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "arguments": f.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in functions
            ],
            "x-guidance": {"whitespace_flexible": False},
        }

        def tag(text: str) -> str:
            return grammar_tag(text, token_id)

        repeat = '("\\n" call)*' if parallel and name is None else ""
        return (
            f"start: call {repeat}\n"
            f'call: {tag(self.start_tag)} "\\n" body "\\n" {tag(self.end_tag)}\n'
            f"body: %json {json.dumps(call_schema)}\n"
        )

    def _find_end(self, body: str, call: OpenCall) -> int | None:
        scan = call.end_scan
        while True:
            if scan.depth or scan.in_string:
                if scan.feed(body) is None:
                    return None
                continue
            end = body.find(self.end_tag, scan.pos)
            opener = _OPENERS.search(body, scan.pos)
            if end >= 0 and (opener is None or end < opener.start()):
                return end
            if opener is None:
                scan.pos = max(scan.pos, len(body) - len(self.end_tag) + 1)
                return None
            scan.pos = opener.start()
            scan.feed(body)

    def _parse_head(self, body: str) -> CallHead | None:
        m = _HEAD.match(body[:_HEAD_SPAN])
        if m is None:
            return None
        try:
            name = json.loads(m.group(1))
        except ValueError:
            return None
        return CallHead(name=name, id=None, args_start=m.end())

    def _tail_ok(self, body: str, args_end: int) -> bool:
        return json_object(body) is not None

    def _parse_other(self, body: str) -> tuple[str, str] | None:
        call = json_object(body)
        if call is None or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments")
        if args is None:
            return call["name"], "{}"
        if isinstance(args, dict):
            return call["name"], json.dumps(args, ensure_ascii=False)
        if isinstance(args, str) and json_object(args) is not None:
            return call["name"], args
        return None

    def _new_id(self) -> str:
        return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))
