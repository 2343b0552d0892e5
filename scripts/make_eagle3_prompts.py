"""Write benchmarks/data/eagle3_prompts.jsonl: the prompts an EAGLE-3 head is trained on
(scripts/train_eagle3.py), made from templates with a fixed seed, so the file is reproducible and
nothing is downloaded.

Three kinds, in the proportions of an agent's traffic: `tool` (reply with one JSON function call,
sometimes after earlier calls and their results), `code` (edit a short Python file and return it
whole: the answer quotes the prompt) and `chat` (free questions). One JSON object per line:
{"kind": ..., "messages": [{"role": ..., "content": ...}, ...]}.

    python scripts/make_eagle3_prompts.py [--out PATH] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "eagle3_prompts.jsonl"
COUNTS = {"tool": 128, "code": 96, "chat": 96}

CITIES = ("Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Denver", "Mumbai", "Cairo", "Seoul", "Quito")
PEOPLE = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
FILES = (
    "src/app.py",
    "lib/cache.py",
    "server/routes.py",
    "tests/test_api.py",
    "cli/main.py",
    "core/scheduler.py",
    "utils/paths.py",
    "models/user.py",
    "docs/index.md",
    "setup.cfg",
)
WORDS = (
    "timeout",
    "retry",
    "cache",
    "token",
    "session",
    "config",
    "parser",
    "queue",
    "worker",
    "logger",
    "handler",
    "buffer",
    "index",
    "limit",
    "schema",
    "client",
)
CURRENCIES = ("USD", "EUR", "JPY", "GBP", "INR", "BRL", "CHF")
TOPICS = (
    "recursion",
    "hash tables",
    "photosynthesis",
    "inflation",
    "black holes",
    "TCP",
    "vaccines",
    "compound interest",
    "git rebase",
    "garbage collection",
    "plate tectonics",
    "neural networks",
    "the water cycle",
    "public-key cryptography",
    "unit testing",
)


def _tool(name: str, desc: str, **params: str) -> dict:
    props = {k: {"type": v} for k, v in params.items()}
    return {
        "name": name,
        "description": desc,
        "parameters": {"type": "object", "properties": props, "required": list(params)},
    }


TOOLS = {
    "get_weather": _tool("get_weather", "Current weather in a city.", city="string", unit="string"),
    "read_file": _tool(
        "read_file",
        "Read lines of a repository file.",
        path="string",
        start_line="integer",
        end_line="integer",
    ),
    "search": _tool(
        "search", "Search the repository for a regular expression.", pattern="string", path="string"
    ),
    "edit_file": _tool(
        "edit_file",
        "Replace one exact string in a file.",
        path="string",
        old_string="string",
        new_string="string",
    ),
    "run_tests": _tool("run_tests", "Run the tests under a path.", path="string", keyword="string"),
    "send_email": _tool(
        "send_email", "Send an email.", to="string", subject="string", body="string"
    ),
    "convert_currency": _tool(
        "convert_currency",
        "Convert an amount of money.",
        amount="number",
        source="string",
        target="string",
    ),
    "create_issue": _tool(
        "create_issue", "Open an issue in the tracker.", title="string", body="string"
    ),
    "book_meeting": _tool(
        "book_meeting", "Book a meeting.", title="string", day="string", minutes="integer"
    ),
}


def tool_task(rng: random.Random) -> tuple[str, str, dict]:
    """(tool name, user request, the arguments a correct call carries)."""
    name = rng.choice(sorted(TOOLS))
    city, who, f, w = rng.choice(CITIES), rng.choice(PEOPLE), rng.choice(FILES), rng.choice(WORDS)
    line = rng.randint(1, 300)
    tasks = {
        "get_weather": (
            f"What's the weather in {city} right now, in celsius?",
            {"city": city, "unit": "celsius"},
        ),
        "read_file": (
            f"Show me lines {line} to {line + 40} of {f}.",
            {"path": f, "start_line": line, "end_line": line + 40},
        ),
        "search": (
            f"Find every place where `{w}` is used under {f.split('/')[0]}/.",
            {"pattern": w, "path": f.split("/")[0]},
        ),
        "edit_file": (
            f"In {f}, rename the variable `{w}` to `{w}_s`.",
            {"path": f, "old_string": w, "new_string": f"{w}_s"},
        ),
        "run_tests": (
            f"Run the tests in tests/ that mention {w}.",
            {"path": "tests/", "keyword": w},
        ),
        "send_email": (
            f"Email {who.lower()}@example.com that the {w} fix is merged.",
            {
                "to": f"{who.lower()}@example.com",
                "subject": f"{w} fix merged",
                "body": f"Hi {who}, the {w} fix is merged.",
            },
        ),
        "convert_currency": (
            f"How much is {line} {CURRENCIES[line % 7]} in {CURRENCIES[(line + 3) % 7]}?",
            {"amount": line, "source": CURRENCIES[line % 7], "target": CURRENCIES[(line + 3) % 7]},
        ),
        "create_issue": (
            f"Open an issue: the {w} in {f} leaks memory under load.",
            {"title": f"{w} leaks memory", "body": f"The {w} in {f} leaks under load."},
        ),
        "book_meeting": (
            f"Book a {15 * (1 + line % 4)} minute {w} review with {who} on Monday.",
            {"title": f"{w} review with {who}", "day": "Monday", "minutes": 15 * (1 + line % 4)},
        ),
    }
    request, args = tasks[name]
    return name, request, args


def tool_prompt(rng: random.Random) -> list[dict]:
    names = rng.sample(sorted(TOOLS), 4)
    turns: list[dict] = []
    for _ in range(rng.choice((0, 0, 1, 2))):  # earlier calls of this conversation and results
        name, request, args = tool_task(rng)
        names.append(name)
        turns += [
            {"role": "user", "content": request},
            {"role": "assistant", "content": json.dumps({"name": name, "arguments": args})},
            {
                "role": "user",
                "content": "Result: " + json.dumps({"ok": True, "id": rng.randint(1, 999)}),
            },
        ]
    name, request, _ = tool_task(rng)
    names.append(name)
    schemas = "\n".join(json.dumps(TOOLS[n]) for n in sorted(set(names)))
    system = (
        "You are an assistant that acts by calling functions. Reply with exactly one JSON object "
        '{"name": <function name>, "arguments": {...}} and nothing else.\nFunctions:\n' + schemas
    )
    return [{"role": "system", "content": system}, *turns, {"role": "user", "content": request}]


def code_file(rng: random.Random) -> tuple[str, str]:
    """(a short Python file, the name of its main function)."""
    w, v = rng.sample(WORDS, 2)
    n = rng.randint(2, 9)
    fn = f"{rng.choice(('load', 'count', 'merge', 'parse', 'filter', 'total'))}_{w}s"
    bodies = (
        f"def {fn}(items, limit={n}):\n    result = []\n    for item in items:\n"
        f"        if item.{v} > limit:\n            result.append(item)\n    return result\n",
        f"def {fn}(path):\n    with open(path) as f:\n        lines = f.read().splitlines()\n"
        f"    {v}s = {{}}\n    for line in lines:\n        key, _, value = line.partition('=')\n"
        f"        {v}s[key.strip()] = value.strip()\n    return {v}s\n",
        f"def {fn}(values):\n    total = 0\n    for i in range(len(values)):\n"
        f"        total += values[i] * {n}\n    return total\n",
        f"class {w.capitalize()}Store:\n    def __init__(self):\n        self.{v}s = {{}}\n\n"
        f"    def {fn}(self, key, default=None):\n        if key in self.{v}s:\n"
        f"            return self.{v}s[key]\n        return default\n",
    )
    return f"import os\n\n\n{rng.choice(bodies)}", fn


def code_prompt(rng: random.Random) -> list[dict]:
    src, fn = code_file(rng)
    edit = rng.choice(
        (
            f"Rename `{fn}` to `get_{fn}` everywhere.",
            "Add type hints to every function and method.",
            f"Add a one-line docstring to `{fn}`.",
            "Remove the unused import.",
            "Replace the loop with a comprehension where it reads better.",
            f"Make `{fn}` raise ValueError when its first argument is empty.",
            "Add a module docstring that says what the file is for.",
        )
    )
    return [{"role": "user", "content": f"{edit} Return the whole file.\n\n```python\n{src}```"}]


def chat_prompt(rng: random.Random) -> list[dict]:
    topic, other = rng.sample(TOPICS, 2)
    who, w = rng.choice(PEOPLE), rng.choice(WORDS)
    text = rng.choice(
        (
            f"Explain {topic} to a {rng.choice(('child', 'student', 'manager', 'new engineer'))} "
            f"in {rng.randint(2, 5)} sentences.",
            f"What is the difference between {topic} and {other}?",
            f"Write a short, friendly email to {who} asking to move our {w} meeting to Friday.",
            f"Give me {rng.randint(3, 6)} ideas for a weekend project about {topic}.",
            f"Write a haiku about {topic}.",
            f"List the steps to set up a {w} for a small web service.",
            f"Summarize in one sentence: {topic.capitalize()} matters because it shows up in everyday "
            f"work, from {w} design to debugging, and understanding it saves time.",
            f"Is it a good idea to learn {topic} before {other}? Answer briefly.",
        )
    )
    return [{"role": "user", "content": text}]


def make(seed: int) -> list[dict]:
    rng = random.Random(seed)
    makers = {"tool": tool_prompt, "code": code_prompt, "chat": chat_prompt}
    rows: list[dict] = []
    for kind, count in COUNTS.items():
        seen: set[str] = set()
        while len(seen) < count:  # distinct prompts only
            row = {"kind": kind, "messages": makers[kind](rng)}
            if (key := json.dumps(row)) not in seen:
                seen.add(key)
                rows.append(row)
    rng.shuffle(rows)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = make(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
