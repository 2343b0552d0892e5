"""Import a GGUF file (llama.cpp's format) into a Hugging Face-format model directory.

Weights are dequantized with the `gguf` package (tested: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 and the K-quants Q2_K..Q6_K; a type it cannot read is refused, naming type and tensor), renamed
to Hugging Face's names and, for the llama architecture, un-permuted the way transformers' GGUF
loader does it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from ember.models import gguf_tokenizer
from ember.models.config import parse_dtype

# general.architecture -> (HF architecture, HF model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors llama.cpp keeps for itself; transformers drops them too.
_IGNORED = {"rope_freqs.weight"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file, decoded to Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> the Hugging Face parameter name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL:
        return f"{_TOP_LEVEL[stem]}.{suffix}"
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m is None or m[2] not in _PER_LAYER:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")
    return f"model.layers.{m[1]}.{_PER_LAYER[m[2]]}.{m[3]}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows, which pairs rotary halves within each head."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def build_config(meta: dict[str, Any], has_output: bool, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for the file's architecture."""
    arch = meta["general.architecture"]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    architecture, model_type = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = get("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = get("rope.dimension_count")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "dtype": str(dtype).removeprefix("torch."),
    }
    for name in ("bos_token_id", "eos_token_id", "padding_token_id"):
        token_id = meta.get(f"tokenizer.ggml.{name}")
        if token_id is not None:
            config[name.replace("padding", "pad")] = int(token_id)
    if arch == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    return config


def _weights(
    reader: GGUFReader, config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    llama = config["model_type"] == "llama"
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in _IGNORED:
            continue
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} is of type {tensor.tensor_type.name}, which ember "
                "cannot import: the gguf package cannot dequantize it"
            ) from None
        # ggml lists dimensions innermost first; the data arrives as (rows, columns) already.
        values = values.reshape([int(d) for d in reversed(tensor.shape)])
        if llama and ".attn_q." in tensor.name:
            values = unpermute_rotary(values, heads)
        elif llama and ".attn_k." in tensor.name:
            values = unpermute_rotary(values, kv_heads)
        weights[hf_name(tensor.name)] = torch.from_numpy(np.array(values)).to(dtype)
    return weights


def import_gguf(
    file: str | Path, out_dir: str | Path, dtype: str | torch.dtype = "float32"
) -> Path:
    """Write `file` as a Hugging Face model directory under `out_dir`; returns `out_dir`."""
    file, out = Path(file), Path(out_dir)
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {str(file)!r} does not exist")
    torch_dtype = parse_dtype(dtype)
    reader = GGUFReader(file)
    meta = read_metadata(reader)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = build_config(meta, has_output, torch_dtype)
    tokenizer = gguf_tokenizer.build_tokenizer(meta)
    weights = _weights(reader, config, torch_dtype)

    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", gguf_tokenizer.tokenizer_config(meta))
    generation: dict[str, Any] = {"eos_token_id": gguf_tokenizer.eos_token_ids(meta)}
    for key in ("bos_token_id", "pad_token_id"):
        if key in config:
            generation[key] = config[key]
    _write_json(out / "generation_config.json", generation)
    template = meta.get("tokenizer.chat_template")
    if template:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
