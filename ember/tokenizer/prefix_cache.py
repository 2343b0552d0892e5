"""Token ids of recent chat prompts' prefixes: an agent resends its whole conversation every turn,
and tokenizing it all again is the API process's largest cost of a long turn (31.7k tokens of
SmolLM2's byte-level BPE: 82 ms on a 2-core VM, about what an H200 takes to prefill the turn's
new 1,024 tokens over 32k cached ones). With this cache a turn tokenizes only what follows the
longest prefix it shares with a recent prompt of the same namespace (2.5 ms there,
`benchmarks/chat_tokenize.py`).

Why the ids stay exactly those of the whole text: `tokenizers` splits its input at added tokens
before it normalizes, pre-tokenizes or runs the model, and works on each piece alone. A prefix
that ends right after an added token therefore has the ids it had in the earlier prompt, and the
rest is tokenized as `token + rest` with the token's id dropped, so that the rest starts in the
same place as inside the whole text (pre-tokenizers that treat the first piece of an input apart,
Metaspace's `prepend_scheme="first"`, see it as they would there). Only added tokens that cannot
change what is matched around them are cut at: no lstrip, rstrip or single_word, normalized False,
no overlap with another added token's text. A tokenizer on which a probe of texts cut at those
tokens does not give the whole texts' ids gets no cut tokens, and the cache does nothing.

Namespaces (a tenant's prefix-cache salt) never share entries: a hit is tens of milliseconds
faster on a long prompt, so a shared cache would let one tenant time another's prompts.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import tokenizers

KEY_CHARS = 64
"""An entry is found by its namespace and its text's first characters (a system prompt's)."""
MAX_PER_KEY = 16
"""Entries kept per key: conversations that share their first characters (one system prompt)."""

_PROBES = (
    "Hello world",
    " leading space",
    "\n\nnewlines\n",
    "  two spaces and\ttab",
    "digits 12345 and émoji 🙂 and CJK 漢字",
    "",
    "x",
    "<not a token>",
)


@dataclass(slots=True, eq=False)
class _Entry:
    text: str
    ids: array  # 32-bit ids: a list of ints would take 9x the memory
    cuts: list[int]
    """Character offsets just past each cut token in `text`, ascending."""
    counts: list[int]
    """counts[i]: how many ids `text[:cuts[i]]` has."""

    @property
    def nbytes(self) -> int:
        """About what the entry holds: its text (one byte a character for ASCII) and its ids."""
        return len(self.text) + 4 * len(self.ids)


def cut_tokens(backend: tokenizers.Tokenizer) -> dict[str, int]:
    """The added tokens (text -> id) a prompt may be cut after; {} if the probe fails."""
    added = {t.content: (i, t) for i, t in backend.get_added_tokens_decoder().items() if t.content}
    cuts = {}
    for text, (i, t) in added.items():
        if t.lstrip or t.rstrip or t.single_word or t.normalized:
            continue
        if any(_overlap(text, other) for other in added if other != text):
            continue
        cuts[text] = i
    for text, i in list(cuts.items())[:8]:
        for a in _PROBES:
            for b in _PROBES:
                whole = backend.encode(a + text + b, add_special_tokens=False).ids
                head = backend.encode(a + text, add_special_tokens=False).ids
                tail = backend.encode(text + b, add_special_tokens=False).ids
                if tail[:1] != [i] or head + tail[1:] != whole:
                    return {}
    return cuts


def _overlap(a: str, b: str) -> bool:
    """Whether one text contains the other, or an end of one is a start of the other."""
    if a in b or b in a:
        return True
    n = min(len(a), len(b))
    return any(a.endswith(b[:k]) or b.endswith(a[:k]) for k in range(1, n))


class PrefixTokenCache:
    """`encode(text, namespace)`: `text`'s ids (no special tokens added), reusing a recent
    prompt's ids up to the last cut token they share. Thread-safe (the chat route tokenizes in
    worker threads); holds up to about `max_bytes` (256 conversations of 32k tokens take ~70 MB),
    the least recently used key's entries dropped first. One namespace's traffic can push out
    another's entries (a slower next turn for it), never reach them."""

    def __init__(self, backend: tokenizers.Tokenizer, max_bytes: int = 128 << 20) -> None:
        self.backend = backend
        self.max_bytes = max_bytes
        self.nbytes = 0
        """What the entries hold now (`_Entry.nbytes` summed)."""
        self.cuts = cut_tokens(backend)
        self._pattern = (
            re.compile("|".join(re.escape(t) for t in sorted(self.cuts, key=len, reverse=True)))
            if self.cuts
            else None
        )
        self._ids = frozenset(self.cuts.values())
        self._entries: OrderedDict[tuple[str | None, str], list[_Entry]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        """Prompts that reused a cached prefix."""
        self.reused_chars = 0
        """Characters not tokenized again thanks to those hits."""

    def encode(self, text: str, namespace: str | None = None) -> list[int]:
        if self._pattern is None:
            return self._encode(text)
        key = (namespace, text[:KEY_CHARS])
        with self._lock:
            candidates = list(self._entries.get(key, ()))
        best, k = None, 0  # the entry sharing the most, and how many of its cuts are shared
        for e in candidates:
            n = _shared_cuts(e, text)
            if n > k:
                best, k = e, n
        if best is not None:
            cut, count = best.cuts[k - 1], best.counts[k - 1]
            token = self._token_ending_at(text, cut)
            tail = self._encode(token + text[cut:])
            if tail[:1] == [self.cuts[token]]:
                ids = best.ids[:count].tolist() + tail[1:]
                with self._lock:
                    self.hits += 1
                    self.reused_chars += cut
                self._remember(key, text, ids, best.cuts[:k], best.counts[:k])
                return ids
        ids = self._encode(text)
        self._remember(key, text, ids, [], [])
        return ids

    def _encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (see InputProcessor.encode).
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def _token_ending_at(self, text: str, end: int) -> str:
        for token in self.cuts:
            if text.endswith(token, 0, end):
                return token
        raise AssertionError("a cut is always just past a cut token")

    def _remember(
        self,
        key: tuple[str | None, str],
        text: str,
        ids: list[int],
        cuts: list[int],
        counts: list[int],
    ) -> None:
        """Keep `text` and its ids; `cuts` and `counts` are those of a prefix already known (only
        the rest is scanned)."""
        assert self._pattern is not None
        start, first = (cuts[-1], counts[-1]) if cuts else (0, 0)
        cuts = cuts + [m.end() for m in self._pattern.finditer(text, start)]
        counts = counts + [first + i + 1 for i, t in enumerate(ids[first:]) if t in self._ids]
        if not cuts or len(cuts) != len(counts):
            return  # a cut token's text that did not become its id: keep nothing of it
        entry = _Entry(text, array("i", ids), cuts, counts)
        if entry.nbytes > self.max_bytes // 4:
            return
        with self._lock:
            old = self._entries.pop(key, [])
            # An entry this prompt extends is superseded by it.
            kept = [e for e in old if not text.startswith(e.text)][-(MAX_PER_KEY - 1) :] + [entry]
            still = {id(e) for e in kept}
            self.nbytes += entry.nbytes - sum(e.nbytes for e in old if id(e) not in still)
            self._entries[key] = kept
            while self.nbytes > self.max_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= sum(e.nbytes for e in dropped)


def _shared_cuts(entry: _Entry, text: str) -> int:
    """How many of `entry`'s cuts `text` shares the prefix up to (they are shared in order)."""
    lo, hi = 0, len(entry.cuts)  # entry.cuts[:lo] are shared
    while lo < hi:
        mid = (lo + hi) // 2
        if text.startswith(entry.text[: entry.cuts[mid]]):
            lo = mid + 1
        else:
            hi = mid
    return lo
