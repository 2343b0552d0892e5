"""The chat prompts' tokenization cache: every turn of a conversation gets the very ids of a whole
tokenization (real and tiny tokenizers, user text that spells special tokens, unicode, branching
conversations, eviction, threads), namespaces never share entries, and the added tokens it cuts
at are the ones that cannot change what is matched around them."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, models, pre_tokenizers

from ember.tokenizer.prefix_cache import PrefixTokenCache, cut_tokens
from ember.tokenizer.tokenizer import Tokenizer

WORDS = [
    "the",
    "file",
    "test",
    "run",
    "fix",
    "diff",
    "patch",
    "line",
    "import",
    "class",
    "def",
    "return",
    "None",
    "True",
    "é",
    "漢字",
    "🙂",
]


def _text(rng: random.Random, n: int) -> str:
    parts = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.3:
        parts.insert(
            rng.randrange(len(parts) + 1), rng.choice(["\n\n", "  ", "\t", " <|im_end|> "])
        )
    return " ".join(parts)


def _conversation(rng: random.Random, turns: int) -> list[list[dict[str, str]]]:
    """The message lists of each turn: a system prompt, then user / assistant turns."""
    msgs = [{"role": "system", "content": _text(rng, 300)}]
    out = []
    for _ in range(turns):
        msgs.append({"role": "user", "content": _text(rng, rng.randrange(0, 120))})
        out.append(list(msgs))
        msgs.append({"role": "assistant", "content": _text(rng, rng.randrange(1, 60))})
    return out


@pytest.fixture(params=["smollm2", "llama", "qwen3"])
def tokenizer(request, smollm2: Path, tiny_model_dir) -> Tokenizer:
    path = smollm2 if request.param == "smollm2" else tiny_model_dir(request.param)
    return Tokenizer.from_dir(path)


def _whole(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_every_turn_has_the_whole_texts_ids(tokenizer: Tokenizer) -> None:
    cache = PrefixTokenCache(tokenizer.backend)
    assert cache.cuts  # the chat templates' delimiters
    rng = random.Random(0)
    for turn, msgs in enumerate(_conversation(rng, 8)):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        assert cache.encode(text, "ns") == _whole(tokenizer, text), turn
    assert cache.hits == 7 and cache.reused_chars > 0  # every turn after the first


def test_branching_conversations_and_eviction(tokenizer: Tokenizer) -> None:
    """Sessions sharing a system prompt, interleaved, in a cache too small for all of them."""
    rng = random.Random(1)
    sessions = [_conversation(rng, 5) for _ in range(6)]
    shared = sessions[0][0][0]
    for s in sessions:
        for msgs in s:
            msgs[0] = shared
    for max_bytes in (256 << 20, 20_000):
        cache = PrefixTokenCache(tokenizer.backend, max_bytes=max_bytes)
        for turn in range(5):
            for s in sessions:
                text = tokenizer.apply_chat_template(s[turn], add_generation_prompt=True)
                assert cache.encode(text, None) == _whole(tokenizer, text)
        assert cache.hits > 0


def test_namespaces_never_share_entries(tokenizer: Tokenizer) -> None:
    cache = PrefixTokenCache(tokenizer.backend)
    first, second = _conversation(random.Random(2), 2)
    a = tokenizer.apply_chat_template(first, add_generation_prompt=True)
    b = tokenizer.apply_chat_template(second, add_generation_prompt=True)
    cache.encode(a, "tenant-a")
    assert cache.encode(b, "tenant-b") == _whole(tokenizer, b) and cache.hits == 0
    assert cache.encode(b, None) == _whole(tokenizer, b) and cache.hits == 0
    assert cache.encode(b, "tenant-a") == _whole(tokenizer, b) and cache.hits == 1


def test_threads_get_exact_ids(tokenizer: Tokenizer) -> None:
    cache = PrefixTokenCache(tokenizer.backend)
    texts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True)
        for seed in range(4)
        for m in _conversation(random.Random(10 + seed), 4)
    ]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda t: cache.encode(t, "ns"), texts * 2))
    assert got == [_whole(tokenizer, t) for t in texts * 2]


def _word_level(*added: AddedToken) -> tokenizers.Tokenizer:
    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", "x"])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(added))
    return tok


def test_cut_tokens_are_those_that_cannot_change_their_neighbours() -> None:
    tok = _word_level(
        AddedToken("<s>", special=True, normalized=False),
        AddedToken("<r>", special=True, rstrip=True, normalized=False),
        AddedToken("<l>", special=True, lstrip=True, normalized=False),
        AddedToken("<w>", special=True, single_word=True, normalized=False),
        AddedToken("<o>", special=True, normalized=False),
        AddedToken("<o>x", special=True, normalized=False),  # contains <o>: neither is safe
        AddedToken("<n>", special=True, normalized=True),
    )
    assert set(cut_tokens(tok)) == {"<s>"}
    cache = PrefixTokenCache(tok)
    for text in ("a <s> b", "a <s> b <s> x", "a <s> b <o>x <r> a <s>"):
        assert cache.encode(text) == tok.encode(text, add_special_tokens=False).ids


def test_no_added_tokens_no_cache() -> None:
    tok = _word_level()
    cache = PrefixTokenCache(tok)
    assert cache.cuts == {}
    assert cache.encode("a b x") == tok.encode("a b x", add_special_tokens=False).ids


def test_hostile_prompts_stay_exact_and_bounded(tokenizer: Tokenizer) -> None:
    """A user message of thousands of special tokens, and a flood of distinct long prompts: ids
    exact, the cache within its bound, each prompt kept only while it fits."""
    cache = PrefixTokenCache(tokenizer.backend, max_bytes=200_000)
    spam = [{"role": "user", "content": "<|im_end|><|im_start|>" * 3000}]
    for turn in range(2):
        spam.append({"role": "user", "content": f"again {turn}"})
        text = tokenizer.apply_chat_template(spam, add_generation_prompt=True)
        assert cache.encode(text, "x") == _whole(tokenizer, text)
    rng = random.Random(3)
    for i in range(40):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{i} " + _text(rng, 2000)}], add_generation_prompt=True
        )
        assert cache.encode(text, f"tenant-{i}") == _whole(tokenizer, text)
        assert cache.nbytes <= cache.max_bytes
