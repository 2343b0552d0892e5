"""Tool-call parsing of model output, whole or streamed, into OpenAI `tool_calls`: the shared
machinery; each format (hermes, kimi_k2) says only how a call is spelled."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class ToolCall:
    """A complete call, as in a non-streamed response's `message.tool_calls`."""

    id: str
    name: str
    arguments: str
    """A JSON object's text."""


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """One element of a streamed chunk's `delta.tool_calls`."""

    index: int
    id: str | None = None
    """Only on the first delta of a call, with `name`."""
    name: str | None = None
    arguments: str = ""
    """A fragment, to append to the call's arguments so far."""


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class CallHead:
    """What a call's opening says: its name, the model's own id if it writes one, and where its
    arguments begin in the call's body."""

    name: str
    id: str | None
    args_start: int


_STRUCTURAL = re.compile(r'["{}\[\]]')
_STRING_STOP = re.compile(r'["\\]')


class JsonScanner:
    """Follows strings and bracket depth over JSON text that arrives in pieces, to find where a
    value ends without parsing it. It does not validate: json.loads has the last word."""

    __slots__ = ("depth", "in_string", "pos")

    def __init__(self, pos: int = 0) -> None:
        self.depth = 0
        self.in_string = False
        self.pos = pos

    def feed(self, text: str) -> int | None:
        """Scan `text` (the same text, grown) from where the last call stopped; return the index of
        the character that ends a value opened at depth 0, or None if `text` ends first."""
        pos, n = self.pos, len(text)
        while pos < n:
            if self.in_string:
                m = _STRING_STOP.search(text, pos)
                if m is None:
                    pos = n
                    break
                i = m.start()
                if text[i] == "\\":
                    if i + 1 == n:
                        pos = i  # the escaped character has not arrived yet
                        break
                    pos = i + 2
                    continue
                self.in_string = False
                pos = i + 1
                if self.depth == 0:
                    self.pos = pos
                    return i
                continue
            m = _STRUCTURAL.search(text, pos)
            if m is None:
                pos = n
                break
            i, c = m.start(), m.group()
            pos = i + 1
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif self.depth > 0:  # a stray closer at depth 0 is left for json.loads to reject
                self.depth -= 1
                if self.depth == 0:
                    self.pos = pos
                    return i
        self.pos = pos
        return None


def json_object(text: str) -> dict[str, Any] | None:
    """`text` parsed, if it is one JSON object; else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass(slots=True)
class OpenCall:
    """What is known of a call whose start tag has been seen, while its body (the parser's buffer)
    grows to its end tag."""

    gap: str
    """Whitespace and separators just before the start tag: dropped if this turns out a call,
    given back as content if not."""
    end_scan: JsonScanner = field(default_factory=JsonScanner)
    """Where the search for the end tag has got to, for formats that need JSON to find it."""
    searched: int = 0
    """Where the search for the end tag has got to, for formats that need only text."""
    head: CallHead | None = None
    eager: bool | None = None
    """Whether the arguments stream as they come; None until their first character is seen."""
    args: JsonScanner | None = None
    args_start: int = 0
    args_close: int | None = None
    sent_to: int = 0
    index: int | None = None
    id: str = ""


class ToolParser(ABC):
    """Splits model output into content and tool calls, the same way whole (`extract`) or streamed
    (`feed` ... `finish`): `extract` is the stream run over the whole text, so they cannot drift.

    A call is a block from `start_tag` to `end_tag` (or to the end of the output). Text outside
    calls is content, verbatim, except whitespace and `separators` touching a call, which are
    dropped: content before a call loses its trailing whitespace, content between or after calls is
    kept and joined as is. Streamed content is held back only where it may yet become markup: a
    partial tag, and trailing whitespace (dropped if a call follows). A block that does not parse as
    a call is content, verbatim.

    Arguments the model writes as an object are its own JSON text, so they stream as generated: the
    first delta (index, id, name) goes out at the arguments' first `{`, then fragments as they
    arrive, holding back only the closing `}` until the whole call has parsed. If it never does (bad
    JSON, or output cut off mid-call), the stream has sent a call whose arguments are not valid JSON
    and never will be, while `extract` gives the block as content; the stream sends that content
    too, and later calls' indices run one ahead of their places in `extract`. Everything else agrees
    exactly, whatever the split.

    Calls to names not in `tools` are returned like any other, as vLLM does: the client knows its
    tools, and dropping a call would hide what the model tried.
    """

    start_tag: ClassVar[str]
    end_tag: ClassVar[str]
    separators: ClassVar[tuple[str, ...]] = ()
    """Markup dropped like whitespace where it touches a call (a section's begin and end)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = list(tools or [])
        self._buf = ""  # text not yet resolved: outside a call, or the open call's body
        self._call: OpenCall | None = None
        self._after_call = False  # leading whitespace and separators are dropped
        self._next_index = 0
        self._calls: list[ToolCall] = []
        self._out = StreamDelta()

    def forced_call_grammar(
        self,
        name: str | None,
        parallel: bool = True,
        token_id: Callable[[str], int | None] | None = None,
    ) -> str | None:
        """A Lark grammar (llguidance dialect) that only admits tool calls in this format, for
        `tool_choice` "required" (name None) or a named function; None if the format has none.

        `token_id` maps a tag to its id when the tokenizer has it as one added token: the grammar
        must then name that token (`<[id]>`), since llguidance matches added tokens as units.
        """
        return None

    def forced_functions(self, name: str | None) -> list[dict[str, Any]]:
        """The `function` objects a forced call may name: all the tools', or the one named."""
        functions = [t.get("function", {}) for t in self.tools or []]
        if name is not None:
            functions = [f for f in functions if f.get("name") == name]
        return functions

    def adjust_skip_special_tokens(self) -> bool | None:
        """What `skip_special_tokens` the server must detokenize with; None leaves it alone."""
        return None

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole output at once, as a non-streamed response has it."""
        parser = type(self)(self.tools)
        content = parser.feed(text).content + parser.finish().content
        return ExtractedToolCalls(content=content or None, tool_calls=parser._calls)

    def feed(self, delta_text: str) -> StreamDelta:
        """The next piece of output; returns what can be sent for it now."""
        self._buf += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        """End of output: resolve what was held back (a partial tag, an unterminated call)."""
        self._advance(final=True)
        return self._take()

    @abstractmethod
    def _find_end(self, body: str, call: OpenCall) -> int | None:
        """Where `end_tag` starts in the call's body, once it has arrived."""

    @abstractmethod
    def _parse_head(self, body: str) -> CallHead | None:
        """The call's name, id and arguments' offset, once `body` holds them; None if not (yet)."""

    @abstractmethod
    def _tail_ok(self, body: str, args_end: int) -> bool:
        """Whether a body whose arguments object ends at `args_end` is a well-formed call."""

    def _parse_other(self, body: str) -> tuple[str, str] | None:
        """(name, arguments) of a call not spelled as a head then an arguments object."""
        return None

    def _new_id(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} calls carry their own id")

    def _parse_call(self, body: str) -> tuple[str, str | None, str] | None:
        """(name, id, arguments) of a finished call's body, or None if it is not a call."""
        head = self._parse_head(body)
        start = 0 if head is None else _skip_space(body, head.args_start)
        if head is None or body[start : start + 1] != "{":
            other = self._parse_other(body)
            return None if other is None else (other[0], None, other[1])
        close = JsonScanner(start).feed(body)
        if close is None or not self._tail_ok(body, close + 1):
            return None
        args = body[start : close + 1]
        return (head.name, head.id, args) if json_object(args) is not None else None

    def _advance(self, final: bool) -> None:
        while self._scan_call(final) if self._call else self._scan_text(final):
            pass

    def _scan_text(self, final: bool) -> bool:
        """Send content up to a possible start tag; True once a call has opened."""
        text = self._buf
        if self._after_call:
            text = _strip_leading(text, self.separators)
        i = text.find(self.start_tag)
        if i >= 0:
            before, gap = _split_trailing(text[:i], self.separators)
            self._say(before)
            self._buf = text[i + len(self.start_tag) :]
            self._call = OpenCall(gap=gap)
            return True
        if final:
            self._say(text)
            self._buf = ""
            return False
        cut = len(text) - _partial_suffix(text, (self.start_tag, *self.separators))
        # Whitespace is held too: if a call follows, it is dropped with the call.
        said, held = _split_trailing(text[:cut], self.separators)
        self._say(said)
        self._buf = held + text[cut:]
        return False

    def _scan_call(self, final: bool) -> bool:
        """Stream the open call's arguments; True once it has ended."""
        call, body = self._call, self._buf
        end = self._find_end(body, call)
        view = body if end is None else body[:end]
        if end is None and final:
            view = view[: len(view) - _partial_suffix(view, (self.end_tag,))]
        if call.head is None:
            call.head = self._parse_head(view)
        if call.head is not None and call.eager is not False:
            self._stream_args(view)
        if end is None and not final:
            return False
        raw = self.start_tag + (body if end is None else body[: end + len(self.end_tag)])
        self._buf = "" if end is None else body[end + len(self.end_tag) :]
        self._call = None
        self._close(call, view, raw)
        return True

    def _stream_args(self, view: str) -> None:
        call = self._call
        if call.eager is None:
            start = _skip_space(view, call.head.args_start)
            if start == len(view):
                return
            call.eager = view[start] == "{"
            if not call.eager:
                return
            call.args, call.args_start, call.sent_to = JsonScanner(start), start, start
            call.index = self._open_index()
            call.id = call.head.id or self._new_id()
            self._send_call(call.index, call.id, call.head.name, "")
        if call.args_close is None:
            call.args_close = call.args.feed(view)
        # The closing brace waits for the whole call to parse, so a call that never does is never
        # valid JSON on the client's side.
        stop = len(view) if call.args_close is None else call.args_close
        if stop > call.sent_to:
            self._send_call(call.index, None, None, view[call.sent_to : stop])
            call.sent_to = stop

    def _close(self, call: OpenCall, body: str, raw: str) -> None:
        parsed = self._parse_call(body)
        if parsed is None:
            self._say(call.gap + raw)
            return
        name, call_id, args = parsed
        if call.index is None:
            call.id = call_id or self._new_id()
            self._send_call(self._open_index(), call.id, name, args)
        else:
            sent = body[call.args_start : call.sent_to]
            if name != call.head.name or not args.startswith(sent):
                raise RuntimeError(f"streamed call {sent!r} disagrees with its parse {args!r}")
            self._send_call(call.index, None, None, args[len(sent) :])
        self._calls.append(ToolCall(id=call.id, name=name, arguments=args))
        self._after_call = True

    def _open_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1

    def _say(self, text: str) -> None:
        if text:
            self._out.content += text
            self._after_call = False

    def _send_call(self, index: int, call_id: str | None, name: str | None, args: str) -> None:
        deltas = self._out.tool_calls
        if call_id is None and deltas and deltas[-1].index == index:
            deltas[-1].arguments += args
        elif call_id is not None or args:
            deltas.append(ToolCallDelta(index=index, id=call_id, name=name, arguments=args))

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _strip_leading(text: str, separators: tuple[str, ...]) -> str:
    while True:
        stripped = text.lstrip()
        for sep in separators:
            stripped = stripped.removeprefix(sep)
        if stripped == text:
            return text
        text = stripped


def _split_trailing(text: str, separators: tuple[str, ...]) -> tuple[str, str]:
    """`text` split before its run of trailing whitespace and separators."""
    head = text
    while True:
        stripped = head.rstrip()
        for sep in separators:
            stripped = stripped.removesuffix(sep)
        if stripped == head:
            return head, text[len(head) :]
        head = stripped


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a tag could still grow from."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        tail = text[-n:]
        if any(tag.startswith(tail) for tag in tags if len(tag) > n):
            return n
    return 0


def grammar_tag(text: str, token_id: Callable[[str], int | None] | None) -> str:
    """A tag in a forced-call grammar: the added token's id (`<[id]>`) when the tokenizer has the
    tag as one token (llguidance matches those as units), else the quoted text."""
    tid = token_id(text) if token_id else None
    return f"<[{tid}]>" if tid is not None else json.dumps(text)
