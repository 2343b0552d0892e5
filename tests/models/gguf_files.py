"""Tiny GGUF files for the import tests, laid out the way llama.cpp's converter writes them.

A Hugging Face checkpoint becomes a GGUF (llama, qwen2, qwen3; F32 or quantized with gguf's own
quantizers), K-quant tensors come from random blocks (gguf-py can dequantize K-quants but not
make them), and a SentencePiece ("llama" tokenizer model) vocabulary is trained here.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from ember.tokenizer.tokenizer import Tokenizer

QT = gguf.GGMLQuantizationType
K_QUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)

# Where each K-quant block keeps its fp16 super-block scale `d` (and `dmin`, where it has one),
# from ggml's block_q*_K structs.
_K_SCALE_OFFSETS = {
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}

_TOP_LEVEL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_PER_LAYER = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


@dataclass(slots=True)
class GGUFTensor:
    """One tensor as it goes into the file: float values, or raw blocks of `raw_type`."""

    name: str
    data: np.ndarray
    raw_type: gguf.GGMLQuantizationType | None = None


@dataclass(slots=True)
class Vocab:
    """The `tokenizer.ggml.*` metadata of a file."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    token_types: list[int]
    bos_id: int
    eos_id: int
    pre: str | None = None
    merges: list[str] | None = None
    scores: list[float] | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None


def gguf_name(hf_name: str) -> str:
    """The Hugging Face parameter name -> llama.cpp's tensor name."""
    if hf_name in _TOP_LEVEL:
        return _TOP_LEVEL[hf_name]
    # model.layers.N.{self_attn,mlp}.PROJ.{weight,bias}, or model.layers.N.NORM.weight
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_PER_LAYER[parts[-2]]}.{parts[-1]}"


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's reordering of llama q/k rows (convert_hf_to_gguf.py's `permute`)."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def hf_tensors(
    hf_dir: Path, arch: str, quant: Callable[[int], gguf.GGMLQuantizationType] | None = None
) -> Iterator[GGUFTensor]:
    """The checkpoint's tensors under GGUF names; matrix number i quantized to `quant(i)`."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    matrices = 0
    for name, t in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        data = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = permute_rotary(data, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            data = permute_rotary(data, cfg["num_key_value_heads"])
        qtype = quant(matrices) if quant is not None and data.ndim == 2 else None
        matrices += data.ndim == 2
        if qtype is None or qtype == QT.F32:
            yield GGUFTensor(gguf_name(name), data)
        else:
            yield GGUFTensor(gguf_name(name), gguf.quants.quantize(data, qtype), qtype)


def random_k_quant(
    rows: int, cols: int, qtype: gguf.GGMLQuantizationType, std: float, rng: np.random.Generator
) -> np.ndarray:
    """Raw blocks of `qtype` with random quants and fp16 scales that give values of about `std`.

    Every byte pattern is a valid quant, so the quants are random bytes. Values are linear in the
    block scales (`d * q` less `dmin * m`), so `dmin` is set to cancel the mean and `d` to give the
    spread; each block's pair is then scaled by its own factor so that blocks differ.
    """
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % elems:
        raise ValueError(f"{qtype.name} rows need a multiple of {elems} values, got {cols}")
    blocks = rng.integers(0, 256, (rows * cols // elems, size), dtype=np.uint8)
    offsets = _K_SCALE_OFFSETS[qtype]

    def with_scales(d: float, dmin: float, factor: np.ndarray | float = 1.0) -> np.ndarray:
        out = blocks.copy()
        for offset, value in zip(offsets, (d, dmin), strict=False):
            half = np.broadcast_to(np.float16(value) * factor, (len(out),)).astype("<f2")
            out[:, offset : offset + 2] = half.view(np.uint8).reshape(-1, 2)
        return out

    quants = gguf.quants.dequantize(with_scales(1.0, 0.0), qtype)
    ratio = 0.0
    if len(offsets) == 2:
        mins = gguf.quants.dequantize(with_scales(0.0, 1.0), qtype)  # -m, per value
        ratio = float(quants.mean() / -mins.mean())
        quants = quants + ratio * mins
    d = std / float(quants.std())
    factor = rng.uniform(0.5, 1.5, len(blocks)).astype(np.float16)
    return with_scales(d, d * ratio, factor).reshape(rows, cols // elems * size)


def byte_level_vocab(hf_dir: Path) -> Vocab:
    """A tiny checkpoint's byte-level BPE tokenizer as GGUF metadata."""
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    backend = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = Tokenizer.from_dir(hf_dir).backend.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    added = {t["content"]: t["special"] for t in backend["added_tokens"]}
    return Vocab(
        model="gpt2",
        pre="qwen2",
        tokens=tokens,
        token_types=[1 if t not in added else 3 if added[t] else 4 for t in tokens],
        merges=[m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]],
        bos_id=vocab["<|endoftext|>"],
        eos_id=vocab[tok_cfg["eos_token"]],
        pad_id=vocab[tok_cfg["pad_token"]],
        chat_template=tok_cfg["chat_template"],
    )


# llama.cpp's token types (llama_token_type in llama.h).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPM_ADDED = (("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL), ("<think>", USER_DEFINED))
_SPM_CORPUS = ("argparse", "textwrap", "json.encoder", "string", "dataclasses")


def sentencepiece_vocab(size: int, chat_template: str | None = None) -> Vocab:
    """A Llama 2 style vocabulary of exactly `size` tokens, as llama.cpp writes a tokenizer.model.

    `<unk> <s> </s>`, the 256 byte-fallback tokens `<0x00>`..`<0xFF>`, pieces spelled with "▁" for
    spaces and scored by merge order (best first, single characters last), no merges, and a few
    added tokens. Characters outside the small trained alphabet go through byte fallback.
    """
    texts = [inspect.getsource(importlib.import_module(name)) for name in _SPM_CORPUS]
    trained = HFTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=size, limit_alphabet=80, show_progress=False)
    trained.train_from_iterator(texts, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    chars = [t for t in model["vocab"] if len(t) == 1]
    merged = ["".join(m) for m in model["merges"]]

    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    room = size - len(head) - len(chars) - len(SPM_ADDED)
    if room > len(merged):
        raise ValueError(f"the corpus gives {len(merged)} merges, {room} are needed")
    pieces = merged[:room] + chars
    tokens = head + pieces + [t for t, _ in SPM_ADDED]
    if len(set(tokens)) != len(tokens):
        raise ValueError("a trained piece repeats a special or byte token")
    return Vocab(
        model="llama",
        tokens=tokens,
        token_types=[UNKNOWN, CONTROL, CONTROL]
        + [BYTE] * 256
        + [NORMAL] * len(pieces)
        + [kind for _, kind in SPM_ADDED],
        scores=[0.0] * len(head) + [-float(i) for i in range(len(pieces))] + [0.0] * len(SPM_ADDED),
        unk_id=0,
        bos_id=1,
        eos_id=tokens.index("<|im_end|>"),
        add_bos=True,
        chat_template=chat_template,
    )


def write_gguf(
    path: Path, arch: str, cfg: dict[str, Any], vocab: Vocab, tensors: Iterator[GGUFTensor]
) -> Path:
    """A GGUF file of `arch` with the Hugging Face config `cfg`'s shape, `vocab` and `tensors`."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # As convert_hf_to_gguf.py: key/value lengths where the config states head_dim, and llama's
    # rotary width.
    if "head_dim" in cfg:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    _add_vocab(w, vocab)
    for t in tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_vocab(w: gguf.GGUFWriter, vocab: Vocab) -> None:
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    if vocab.unk_id is not None:
        w.add_unk_token_id(vocab.unk_id)
    if vocab.pad_id is not None:
        w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template is not None:
        w.add_chat_template(vocab.chat_template)
