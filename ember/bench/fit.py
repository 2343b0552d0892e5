"""What the server is and what fits it: the model name and `max_model_len` from `/v1/models`, the
agentic workload sized in the server's own tokens (measured by two probe requests, since the
workload's text is words and tokenizers differ), and trace or random requests cut to fit.

A workload that does not fit would only measure 400s (the README's examples against a 2,048-token
server once did: 8 of 8 agentic and 19 of 20 trace requests rejected), so it is scaled down with a
warning instead."""

from __future__ import annotations

import dataclasses
import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ember.bench.records import PlannedRequest
from ember.bench.workloads.agentic import TOOLS, agent_system_prompt
from ember.bench.workloads.prompts import fit_lengths

ANSWER_SLACK = 1.25
"""An answer of N tokens, sent back as text, may tokenize to a few more."""
TURN_OVERHEAD_TOKENS = 16
"""Chat-template tokens of the two messages each turn adds (assistant, tool result)."""
PROBE_WORDS = 400


class BenchError(Exception):
    """A one-line reason `ember bench` cannot run (no traceback)."""


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model: str
    max_model_len: int | None
    """None when the server does not say (not every OpenAI-compatible server does)."""


def _call(url: str, api_key: str | None, body: dict[str, Any] | None = None) -> Any:
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace")
        hint = " (give --api-key)" if e.code == 401 else ""
        raise BenchError(f"{url} answered HTTP {e.code}{hint}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BenchError(f"cannot reach {url}: {reason}") from e
    except ValueError as e:
        raise BenchError(f"{url} did not answer JSON: {e}") from e


def server_info(base_url: str, api_key: str | None) -> ServerInfo:
    doc = _call(base_url.rstrip("/") + "/v1/models", api_key)
    try:
        first = doc["data"][0]
    except (KeyError, IndexError, TypeError) as e:
        raise BenchError(f"{base_url}/v1/models lists no model") from e
    limit = first.get("max_model_len")
    return ServerInfo(str(first["id"]), limit if isinstance(limit, int) and limit > 0 else None)


def _prompt_tokens(base_url: str, api_key: str | None, model: str, system: str) -> int:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Task:"}],
        "tools": list(TOOLS),
        "max_tokens": 1,
        "temperature": 0,
    }
    doc = _call(base_url.rstrip("/") + "/v1/chat/completions", api_key, body)
    try:
        return int(doc["usage"]["prompt_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise BenchError("the server reported no usage.prompt_tokens for a probe request") from e


@dataclass(frozen=True, slots=True)
class AgenticSize:
    """The agentic workload's lengths: `system_words` and the ranges in words, `max_tokens`."""

    system_words: int
    user_words: tuple[int, int]
    tool_result_words: tuple[int, int]
    max_tokens: int
    tokens_per_word: float
    fixed_tokens: int
    """The template and the six tool schemas: every request carries them."""

    def last_turn_tokens(self, turns: int) -> float:
        """A generous estimate of the last turn's prompt plus its answer."""
        r = self.tokens_per_word
        grow = self.max_tokens * ANSWER_SLACK + self.tool_result_words[1] * r
        return (
            self.fixed_tokens
            + (self.system_words + self.user_words[1]) * r
            + (turns - 1) * (grow + TURN_OVERHEAD_TOKENS)
            + self.max_tokens
        )


def size_agentic(
    base_url: str,
    api_key: str | None,
    info: ServerInfo,
    *,
    system_tokens: int,
    turns: int,
    max_tokens: int,
    user_words: tuple[int, int] = (50, 200),
    tool_result_words: tuple[int, int] = (200, 600),
) -> AgenticSize:
    """Measure the server's tokens per word of the workload's text and the fixed cost of the
    template and tools (two probes whose first words differ from the workload's, so they leave no
    block the run could hit), then fit the last turn within `max_model_len`, scaling every length
    down together if needed (with a warning)."""
    # "Probe." first: the probes share no full cache block with the workload's "You are ..." prompt.
    fixed = _prompt_tokens(base_url, api_key, info.model, "Probe.")
    if info.max_model_len is not None and fixed >= info.max_model_len:
        raise BenchError(
            f"the tool schemas alone take {fixed} tokens, more than the server's "
            f"max_model_len {info.max_model_len}"
        )
    n = PROBE_WORDS
    if info.max_model_len is not None:
        n = max(100, min(n, (info.max_model_len - fixed) // 3))
    # The system prompt's own style (numbered, capitalised rules), as the run will send it.
    system = agent_system_prompt(n)
    text = "Probe. " + system
    words = len(system.split())
    per_word = max(0.5, (_prompt_tokens(base_url, api_key, info.model, text) - fixed) / words)
    size = AgenticSize(
        round(system_tokens / per_word), user_words, tool_result_words, max_tokens, per_word, fixed
    )
    if info.max_model_len is None:
        return size
    room = info.max_model_len - fixed - (turns - 1) * TURN_OVERHEAD_TOKENS
    need = size.last_turn_tokens(turns) - fixed - (turns - 1) * TURN_OVERHEAD_TOKENS
    if need <= room:
        return size
    scale = room / need
    if scale <= 0 or max_tokens * scale < 1:
        raise BenchError(
            f"{turns} turns do not fit the server's max_model_len {info.max_model_len} "
            f"(the template and tools take {fixed} tokens): use fewer --turns"
        )

    def shrink(span: tuple[int, int]) -> tuple[int, int]:
        lo, hi = (max(1, int(x * scale)) for x in span)
        return lo, max(lo, hi)

    fitted = dataclasses.replace(
        size,
        system_words=int(size.system_words * scale),
        user_words=shrink(user_words),
        tool_result_words=shrink(tool_result_words),
        max_tokens=max(1, int(max_tokens * scale)),
    )
    warn(
        f"the agentic workload does not fit the server's max_model_len {info.max_model_len}: "
        f"scaled to a {round(fitted.system_words * per_word)}-token system prompt "
        f"(asked {system_tokens}), tool results of {fitted.tool_result_words[0]}-"
        f"{fitted.tool_result_words[1]} words and max_tokens {fitted.max_tokens} "
        f"(asked {max_tokens})"
    )
    return fitted


def fit_requests(planned: list[PlannedRequest], limit: int | None) -> list[PlannedRequest]:
    """Token-id requests cut to the server's context (a warning says how many)."""
    if limit is None:
        return planned
    cut = 0
    for req in planned:
        prompt, out = req.body["prompt"], req.body["max_tokens"]
        n, m = fit_lengths(len(prompt), out, limit)
        if (n, m) != (len(prompt), out):
            cut += 1
            req.body["prompt"], req.body["max_tokens"] = prompt[:n], m
            if req.ideal_cached_tokens is not None:
                req.ideal_cached_tokens = min(req.ideal_cached_tokens, n)
    if cut:
        warn(
            f"{cut} of {len(planned)} requests did not fit the server's max_model_len {limit}: "
            "their prompts (and outputs beyond half the context) were cut to fit"
        )
    return planned


def warn(text: str) -> None:
    print(f"ember bench: warning: {text}", file=sys.stderr, flush=True)
