"""The prompt sets of benchmarks/spec_decode.py, rendered with the model's chat template as the
server renders them: agentic tool calls (the `ember bench` agentic workload's sessions, with tool
calls as the earlier answers), code editing (benchmarks/data/spec_code_edit.jsonl) and free chat
(benchmarks/data/spec_chat.jsonl); and what a set's answers look like.

A module of benchmarks/spec_decode.py, not run on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ember.bench.workloads.agentic import TOOLS, WORDS, AgenticWorkload
from ember.tokenizer.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent / "data"


def tool_call(rng: np.random.Generator) -> str:
    """An answer of the agent: one call of a workload tool, in the Hermes format."""

    def w() -> str:
        return str(rng.choice(WORDS))

    path = f"ember/{w()}/{w()}_{w()}.py"
    name = str(rng.choice(["read_file", "search", "edit_file", "run_tests", "run_shell"]))
    first = int(rng.integers(1, 400))
    args: dict[str, Any] = {
        "read_file": {"path": path, "start_line": first, "end_line": first + 60},
        "search": {"pattern": f"def {w()}_{w()}", "path": "ember"},
        "edit_file": {"path": path, "old_string": f"{w()} = {w()}", "new_string": f"{w()} = {w()}"},
        "run_tests": {"path": f"tests/test_{w()}.py", "keyword": w()},
        "run_shell": {"command": f"git diff --stat -- {path}"},
    }[name]
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The tools in the system prompt, for a template that drops them (SmolLM2's does)."""
    listing = "\n".join(json.dumps(t) for t in tools)
    return (
        "\n\n# Tools\n\nYou may call the functions described in JSON inside <tools></tools>:\n"
        f"<tools>\n{listing}\n</tools>\n\nTo call one, answer with its name and arguments as a "
        "JSON object inside <tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
    )


def agentic(n: int, quick: bool) -> list[list[dict[str, Any]]]:
    """Session i at turn i % 4: the workload's messages, with tool calls as the earlier answers."""
    small = dict(system_words=60, tool_result_words=(10, 20), user_words=(10, 20))
    kw = small if quick else dict(system_words=1000, tool_result_words=(100, 300))
    wl = AgenticWorkload(n, 4, model="spec_decode", **kw)  # type: ignore[arg-type]
    convs = []
    for i in range(n):
        req, rng = wl.first(i), np.random.default_rng([7, i])
        for _ in range(i % wl.turns):
            req = wl.next(req, tool_call(rng))  # type: ignore[assignment]
        convs.append(req.body["messages"])
    return convs


def code_edit(n: int) -> list[list[dict[str, Any]]]:
    """Edit k of every file before edit k + 1, so the first prompts are of different files."""
    rows = [json.loads(s) for s in (DATA / "spec_code_edit.jsonl").read_text().splitlines()]
    pairs = [(r, e) for k in range(len(rows[0]["edits"])) for r in rows for e in [r["edits"][k]]]
    return [
        [
            {
                "role": "user",
                "content": f"Here is the file `{r['file']}`:\n\n```python\n{r['code']}```\n\n{edit}"
                " Reply with the whole updated file in one ```python block and nothing else.",
            }
        ]
        for r, edit in pairs[:n]
    ]


def chat(n: int) -> list[list[dict[str, Any]]]:
    rows = [json.loads(s) for s in (DATA / "spec_chat.jsonl").read_text().splitlines()]
    return [[{"role": "user", "content": r["prompt"]}] for r in rows[:n]]


def render(
    tok: Tokenizer, messages: list[dict[str, Any]], tools: list | None
) -> tuple[list[int], str]:
    """Token ids as the chat route makes them; where the tool schemas went."""
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    where = "template" if tools else "none"
    if tools and tools[0]["function"]["name"] not in text:
        sys_msg = {**messages[0], "content": messages[0]["content"] + tools_block(tools)}
        text = tok.apply_chat_template([sys_msg, *messages[1:]], add_generation_prompt=True)
        where = "system prompt (the template drops tools)"
    return tok.encode(text, add_special_tokens=False), where


def prompt_sets(
    tok: Tokenizer, n: int, names: list[str], quick: bool
) -> tuple[dict[str, list[list[int]]], dict[str, Any]]:
    build = {
        "agentic": lambda: agentic(n, quick),
        "code": lambda: code_edit(n),
        "chat": lambda: chat(n),
    }
    sets, info = {}, {}
    for name in names:
        # --quick: two tools, so the tiny model's context holds the prompt and the CPU is quick.
        tools = list(TOOLS[:2] if quick else TOOLS) if name == "agentic" else None
        rendered = [render(tok, m, tools) for m in build[name]()]
        sets[name] = [ids for ids, _ in rendered]
        lens = [len(ids) for ids in sets[name]]
        info[name] = {
            "prompts": len(lens),
            "mean_prompt_tokens": sum(lens) / len(lens),
            "max_prompt_tokens": max(lens),
            "tools": rendered[0][1],
        }
    return sets, info


def answer_shape(tok: Tokenizer, set_name: str, tokens: list[list[int]]) -> dict[str, Any]:
    """What the answers are (a sample, and the share in the set's expected form), so a table
    of speedups on answers that are not tool calls or code is not mistaken for one that is."""
    texts = [tok.decode(t) for t in tokens]
    marker = {"agentic": "<tool_call>", "code": "```"}.get(set_name)
    shape: dict[str, Any] = {"sample": texts[0][:300]}
    if marker is not None:
        shape[f"share_with_{'tool_call' if set_name == 'agentic' else 'code_block'}"] = sum(
            marker in t for t in texts
        ) / len(texts)
    return shape
