"""The agentic workload: sessions of a coding agent whose every turn resends the whole conversation
(one long system prompt, the tool schemas, each answer and tool result so far) plus a new result."""

from __future__ import annotations

import copy
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from ember.bench.records import PlannedRequest
from ember.bench.workloads.arrivals import poisson_arrivals

CHAT_PATH = "/v1/chat/completions"

# Common words: each is about one token for real tokenizers, which is all the sizing needs.
WORDS: tuple[str, ...] = tuple(
    """the a of to in and is for that it on with as be this by are from or at an not file code
    test function class method module package value error return call line name type path list
    string number result output input data state change update check build run read write open
    close import export config option default user request response server client cache block
    token model batch queue worker thread process memory buffer index key map set array field
    object node tree graph edge loop branch commit merge patch diff version release log debug
    trace issue fix bug feature refactor rename move delete create add remove replace search find
    match pattern parse format render handle raise catch retry timeout limit size count total
    first last next previous start end begin finish step stage phase task job schedule plan
    """.split()  # noqa: SIM905 (a word list reads better as text)
)

SYSTEM_PREAMBLE = (
    "You are a coding agent working in a software repository. You solve the user's task by "
    "calling the tools you are given: read files before you change them, keep each edit small, "
    "run the tests after every change and read their output, and search the code instead of "
    "guessing where something lives. Never invent file contents or test results. When the task "
    "is done, say what you changed and why in a few sentences. The rules below are the project's "
    "conventions; follow them in every file you touch."
)

TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the repository, optionally only a range of lines.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to the repo root."},
                    "start_line": {"type": "integer", "minimum": 1},
                    "end_line": {"type": "integer", "minimum": 1},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create a file or overwrite it entirely with new content.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to the repo root."},
                    "content": {"type": "string", "description": "The whole new file."},
                },
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Replace one exact, unique occurrence of a string in a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old_string": {"type": "string", "description": "Text to replace, verbatim."},
                    "new_string": {"type": "string"},
                },
                "required": ["path", "old_string", "new_string"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the repository for a regular expression; returns matching lines.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "description": "A Python regular expression."},
                    "path": {"type": "string", "description": "Directory to search in."},
                    "max_results": {"type": "integer", "minimum": 1, "default": 50},
                },
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, or the tests under a path, and return the report.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "A test file or directory."},
                    "keyword": {"type": "string", "description": "Only tests matching this."},
                    "timeout_s": {"type": "integer", "minimum": 1, "default": 600},
                },
                "required": [],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the repository root; returns stdout and stderr.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout_s": {"type": "integer", "minimum": 1, "default": 120},
                },
                "required": ["command"],
            },
        },
    },
)


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n).tolist())


def agent_system_prompt(words: int) -> str:
    """The agent's system prompt, about `words` words: the preamble, then numbered rules. The same
    for every session and seed, as one agent's prompt is."""
    rng = np.random.default_rng(0)
    parts = [SYSTEM_PREAMBLE]
    count, rule = len(SYSTEM_PREAMBLE.split()), 1
    while count < words:
        n = min(int(rng.integers(8, 25)), max(words - count - 1, 1))
        parts.append(f"{rule}. {_words(rng, n).capitalize()}.")
        count, rule = count + n + 1, rule + 1
    return "\n".join(parts)


def _range(value: tuple[int, int], name: str) -> None:
    lo, hi = value
    if not 0 <= lo <= hi:
        raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi, got {value!r}")


@dataclass(slots=True)
class AgenticWorkload:
    """`sessions` agent sessions of `turns` chat requests each, driven turn by turn.

    The runner starts session i at `session_start(i)` with `first(i)`, and after each answer (and
    `think_time_s`) sends `next(prev, answer_text)` until it returns None. Every request carries
    `session`; the runner sends it as `x-session-affinity` when `affinity` is True. Lengths are
    in words (the workload has no tokenizer): `ember bench` converts its token counts with the
    server's measured tokens per word (ember.bench.fit).
    """

    sessions: int
    turns: int
    _: KW_ONLY
    model: str
    system_words: int = 3000
    tool_result_words: tuple[int, int] = (200, 600)
    user_words: tuple[int, int] = (50, 200)
    max_tokens: int = 256
    think_time_s: float = 0.0
    rate: float | None = None
    """Session arrivals per second (Poisson); None starts every session at 0."""
    affinity: bool = True
    seed: int = 0
    system_prompt: str = field(init=False, repr=False)
    _starts: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.sessions < 0 or self.turns < 1:
            raise ValueError(
                f"need sessions >= 0 and turns >= 1, got {self.sessions}, {self.turns}"
            )
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        _range(self.tool_result_words, "tool_result_words")
        _range(self.user_words, "user_words")
        self.system_prompt = agent_system_prompt(self.system_words)
        self._starts = poisson_arrivals(self.sessions, self.rate, np.random.default_rng(self.seed))

    def session_start(self, session_idx: int) -> float:
        """When session `session_idx` arrives, in seconds after the run starts."""
        self._check_index(session_idx)
        return self._starts[session_idx]

    def first(self, session_idx: int) -> PlannedRequest:
        """Turn 0 of a session: the system prompt and the user's task."""
        self._check_index(session_idx)
        rng = self._rng(session_idx, 0)
        task = _words(rng, int(rng.integers(*self.user_words, endpoint=True)))
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": f"Task: {task}"},
        ]
        return self._request(session_idx, 0, messages)

    def next(self, prev: PlannedRequest, answer_text: str) -> PlannedRequest | None:
        """The turn after `prev`: its messages, the answer, then a tool result. None after the last."""
        session_idx = self._index_of(prev)
        turn = prev.turn + 1
        if turn >= self.turns:
            return None
        rng = self._rng(session_idx, turn)
        result = _words(rng, int(rng.integers(*self.tool_result_words, endpoint=True)))
        messages = [
            *prev.body["messages"],
            {"role": "assistant", "content": answer_text},
            {"role": "user", "content": f"Tool result: {result}"},
        ]
        return self._request(session_idx, turn, messages)

    def _request(
        self, session_idx: int, turn: int, messages: list[dict[str, Any]]
    ) -> PlannedRequest:
        session = f"ses_{session_idx}"
        body = {
            "model": self.model,
            "messages": messages,
            "tools": copy.deepcopy(list(TOOLS)),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        return PlannedRequest(
            request_id=f"{session}-turn-{turn}",
            path=CHAT_PATH,
            body=body,
            session=session,
            turn=turn,
        )

    def _rng(self, session_idx: int, turn: int) -> np.random.Generator:
        # Keyed by (seed, session, turn), so a turn's text does not depend on the order turns run.
        return np.random.default_rng([self.seed, session_idx, turn])

    def _check_index(self, session_idx: int) -> None:
        if not 0 <= session_idx < self.sessions:
            raise IndexError(f"session {session_idx} out of range [0, {self.sessions})")

    def _index_of(self, prev: PlannedRequest) -> int:
        prefix = "ses_"
        if prev.session is None or not prev.session.startswith(prefix):
            raise ValueError(f"request {prev.request_id} is not from an agentic session")
        session_idx = int(prev.session.removeprefix(prefix))
        self._check_index(session_idx)
        return session_idx
