"""The chat handler's streamed chunks, built from growing outputs, against its whole response:
what an openai client accumulates from the stream equals the non-streamed message."""

from __future__ import annotations

import json
import random

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from ember.outputs import CompletionOutput
from ember.server.protocol import ChatCompletionRequest
from ember.server.serving_chat import ChatHandler, _Choice
from ember.server.tool_parsers import get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
ARGS = {"path": "src/ä.py", "lines": [1, 2], "note": 'say "hi" {ok}'}
CALL = "<tool_call>\n" + json.dumps({"name": "read_file", "arguments": ARGS}) + "\n</tool_call>"
TEXTS = {
    "plain": "Just text, with a < and a {brace}.",
    "one_call": "Let me look.\n" + CALL,
    "two_calls": CALL + "\n" + CALL.replace("src", "lib"),
}


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **kw}
    )


def outputs(text: str, cuts: list[int], finish: str) -> list[CompletionOutput]:
    """The cumulative outputs an engine would produce, the text growing at `cuts`."""
    outs = []
    for k, end in enumerate([*cuts, len(text)]):
        done = end == len(text)
        outs.append(
            CompletionOutput(
                0, text[:end], list(range(k + 1)), finish_reason=finish if done else None
            )
        )
    return outs


def stream_message(handler: ChatHandler, req: ChatCompletionRequest, outs: list[CompletionOutput]):
    parser = get_tool_parser("hermes")(TOOLS)
    st = _Choice(parser)
    state = ChatCompletionStreamState()
    finishes = []
    for o in outs:
        for delta, finish, logprobs in handler._advance(req, st, o, holdback=0):
            chunk = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "tiny",
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
            if finish:
                finishes.append(finish)
    return state.current_completion_snapshot.choices[0].message, finishes


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_streamed_tool_calls_accumulate_to_the_whole_message(name: str, finish: str) -> None:
    handler = ChatHandler.__new__(ChatHandler)  # only the pure formatting methods are used
    handler.parser_cls = get_tool_parser("hermes")
    req = request()
    text = TEXTS[name]
    whole = handler._choice(req, outputs(text, [], finish)[-1], lambda: handler.parser_cls(TOOLS))
    rng = random.Random(name)
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 1 + trial % 12)))
        msg, finishes = stream_message(handler, req, outputs(text, cuts, finish))
        assert finishes == [whole["finish_reason"]]
        assert (msg.content or None) == (whole["message"]["content"] or None)
        got = [(t.function.name, t.function.arguments) for t in msg.tool_calls or []]
        want = [
            (t["function"]["name"], t["function"]["arguments"])
            for t in whole["message"].get("tool_calls", [])
        ]
        assert got == want
    if name != "plain":
        assert [json.loads(a) for _, a in want][0] == ARGS
        assert whole["finish_reason"] == ("tool_calls" if finish == "stop" else "length")
