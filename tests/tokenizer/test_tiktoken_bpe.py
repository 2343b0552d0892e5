"""A tiktoken.model read as ember reads it (Kimi's vocabulary file, no tokenizer.json): the BPE is
transformers' TikTokenConverter's, the ids are tiktoken's own encoding's under Kimi's pattern, and
decode gives the text back. Checked on the tiny kimi_k2 checkpoint's file."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import regex
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Regex, pre_tokenizers
from transformers.convert_slow_tokenizer import TikTokenConverter

from ember.tokenizer.tiktoken_bpe import KIMI_PATTERN, tokenizer_from_tiktoken
from ember.tokenizer.tokenizer import Tokenizer, tokenizer_json

TEXTS = [
    "def tiny_model(x):\n    return x * 2  # 😀",
    "Hello World, I'm fine; you're OK's, THEY'LL go. don't WE'VE",
    "中文English混合，日本語テキストとひらがな。한국어 텍스트",
    "HTTPServer XMLHttpRequest getHTTPResponseCode iPhone McDonald's",
    "1234567 3.14159 1,000,000 ٣٤٥ ⅷ 二〇二五年",
    "naïve café ÉCOLE école Ωmega ΣΑΣ Àb\u0301c e\u0301\u0302",
    "tabs\tand  spaces   \n\n\r\n  \t\n trailing   ",
    "<|im_user|>user<|im_middle|>hi<|im_end|>[BOS] [PAD]x",
    "",
    " ",
    "\u200b\u00a0zero width and nbsp",
    "emoji 👩‍👩‍👧‍👦 🇫🇷 mixed🙂text",
]
INTERESTING = "aZ'sdtlmv \n\r\t0123456789你好世界日本語テキストÉéΣσ한😀.,!-_<|>[]\u0301\u00a0"


@pytest.fixture(scope="module")
def kimi(tiny_model_dir) -> Path:
    return tiny_model_dir("kimi_k2")


@pytest.fixture(scope="module")
def ours(kimi: Path) -> Tokenizer:
    return Tokenizer.from_dir(kimi)


@pytest.fixture(scope="module")
def reference(kimi: Path) -> tiktoken.Encoding:
    """tiktoken's own encoding of the file, with the special tokens of tokenizer_config."""
    added = json.loads((kimi / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken caches by path: never a stale file
        ranks = load_tiktoken_bpe(str(kimi / "tiktoken.model"))
    return tiktoken.Encoding(
        name="kimi-tiny",
        pat_str=KIMI_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={e["content"]: int(i) for i, e in added.items()},
    )


def check(text: str, ours: Tokenizer, reference: tiktoken.Encoding) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text, allowed_special="all")
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert reference.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_tiktoken_and_decode_round_trips(text: str, ours, reference) -> None:
    check(text, ours, reference)


def test_a_whole_source_file_encodes_as_tiktoken_does(ours, reference) -> None:
    import http.server
    import inspect

    text = inspect.getsource(http.server)
    check(text, ours, reference)
    # The vocabulary is real: merges make the ids far fewer than the bytes.
    assert len(ours.encode(text)) < len(text.encode()) / 3


@settings(max_examples=300, deadline=None)
@given(st.text(st.sampled_from(INTERESTING) | st.characters(exclude_categories=["Cs"])))
def test_any_text_encodes_as_tiktoken_does(ours, reference, text: str) -> None:
    check(text, ours, reference)


@pytest.mark.parametrize("text", TEXTS)
def test_the_pattern_splits_as_python_regex_does(text: str) -> None:
    """Oniguruma (tokenizers) reads the pattern's `&&` class intersections as the `regex`
    module's set operations do: Han apart from other letters, cased words split."""
    split = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")
    pieces = [piece for piece, _ in split.pre_tokenize_str(text)]
    assert pieces == regex.findall(KIMI_PATTERN, text, flags=regex.V1)


def test_the_pattern_keeps_han_apart_and_splits_camel_case() -> None:
    split = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")
    pieces = [
        piece for piece, _ in split.pre_tokenize_str("中文English混合 XMLHttpRequest it's 12345")
    ]
    assert pieces == ["中文", "English", "混合", " XMLHttp", "Request", " it's", " ", "123", "45"]


def test_the_bpe_is_transformers_tiktoken_converters(kimi: Path) -> None:
    file = kimi / "tiktoken.model"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        want = json.loads(TikTokenConverter(vocab_file=str(file)).tokenizer().to_str())["model"]
    got = json.loads(tokenizer_from_tiktoken(file, {}).to_str())["model"]
    assert got["vocab"] == want["vocab"]
    assert got["merges"] == want["merges"]
    assert got["ignore_merges"] is want["ignore_merges"] is True


def test_llguidance_reads_the_converted_tokenizer(kimi: Path, ours: Tokenizer) -> None:
    text = json.loads(tokenizer_json(kimi))
    assert text["model"]["type"] == "BPE"
    assert {t["content"]: t["id"] for t in text["added_tokens"]}["<|im_end|>"] == 3058
    assert len(text["added_tokens"]) == ours.vocab_size - 3056


def write_ranks(path: Path, tokens: list[bytes]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    return path


BYTES = [bytes([b]) for b in range(256)]


def test_added_tokens_take_their_ids_and_holes_are_reserved(tmp_path: Path) -> None:
    file = write_ranks(tmp_path / "t.model", [*BYTES, b"ab", b"abc"])
    added = {"258": {"content": "[BOS]", "special": True}, "261": {"content": "<x>"}}
    tok = tokenizer_from_tiktoken(file, added)
    assert tok.get_vocab_size() == 262
    assert [tok.id_to_token(i) for i in range(258, 262)] == [
        "[BOS]",
        "<|reserved_token_259|>",
        "<|reserved_token_260|>",
        "<x>",
    ]
    assert tok.encode("abc<x>abd").ids == [257, 261, 256, ord("d")]
    # `special` says what decode may skip: "<x>" is not special.
    assert tok.decode([258, 257, 261], skip_special_tokens=True) == "abc<x>"


@pytest.mark.parametrize(
    ("lines", "added", "error"),
    [
        (b"YQ== 0\nnot-base64! 1\n", {}, "t.model:2: not `base64"),
        (b"YQ== 0\nYg== 2\n", {}, "ranks are not 0..1"),
        (b"YQ== 0\nYg== 1\n", {"1": {"content": "[BOS]"}}, "fall among the 2 ranks"),
        (b"YQ== 0\nYg== 1\n", {"2": {"content": "a"}}, "'a' cannot have id 2"),
    ],
)
def test_bad_files_are_refused_by_line(
    tmp_path: Path, lines: bytes, added: dict, error: str
) -> None:
    (tmp_path / "t.model").write_bytes(lines)
    with pytest.raises(ValueError, match=regex.escape(error)):
        tokenizer_from_tiktoken(tmp_path / "t.model", added)


def test_tokenizer_json_wins_over_tiktoken_model(tiny_model_dir, tmp_path: Path) -> None:
    """A directory with both files loads its tokenizer.json."""
    qwen = tiny_model_dir("qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((qwen / name).read_bytes())
    write_ranks(tmp_path / "tiktoken.model", BYTES)
    assert Tokenizer.from_dir(tmp_path).vocab_size == Tokenizer.from_dir(qwen).vocab_size


def test_the_conversion_is_cached_by_what_it_was_made_from(tmp_path: Path, monkeypatch) -> None:
    """The first load derives the BPE and caches it; a second reads the cache (the conversion is
    not called) and encodes alike; a changed file or added tokens are a new entry; a torn entry
    is derived again; an unwritable cache only costs the time."""
    import ember.tokenizer.tiktoken_bpe as tb

    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    file = write_ranks(tmp_path / "t.model", [*BYTES, b"ab", b"abc", "中文".encode()])
    added = {"259": {"content": "[BOS]", "special": True}}
    calls = []
    convert = tb.tokenizer_from_tiktoken
    monkeypatch.setattr(tb, "tokenizer_from_tiktoken", lambda *a: calls.append(a) or convert(*a))
    first = tb.cached_tokenizer_from_tiktoken(file, added)
    entries = list((tmp_path / "home" / "tokenizers").iterdir())
    assert len(calls) == 1 and len(entries) == 1
    second = tb.cached_tokenizer_from_tiktoken(file, added)
    assert len(calls) == 1
    for text in ("abcab[BOS]中文 x", "", "ab\nabc"):
        assert second.encode(text).ids == first.encode(text).ids
    tb.cached_tokenizer_from_tiktoken(file, {})  # other added tokens: another entry
    write_ranks(file, [*BYTES, b"ab"])  # another file: another entry
    assert tb.cached_tokenizer_from_tiktoken(file, added).get_vocab_size() == 260
    assert len(calls) == 3 and len(list(entries[0].parent.iterdir())) == 3
    entries[0].write_text('{"torn": ')
    write_ranks(file, [*BYTES, b"ab", b"abc", "中文".encode()])
    assert tb.cached_tokenizer_from_tiktoken(file, added).encode("abc").ids == [257]
    assert len(calls) == 4
    monkeypatch.setenv("EMBER_HOME", str(file))  # a file, not a directory: unwritable
    assert tb.cached_tokenizer_from_tiktoken(file, added).encode("abc").ids == [257]
