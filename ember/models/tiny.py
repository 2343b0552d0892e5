"""Tiny random Hugging Face checkpoints (llama, qwen2, qwen3, qwen3_moe, deepseek_v3, kimi_k2)
for tests.

Each is a complete model directory: config, generation config, safetensors weights and a real
byte-level BPE tokenizer trained at make time on Python's own standard library sources. kimi_k2 is
DeepSeek-V3's tiny with Kimi K2's tokenizer conventions (tiny_kimi.py): that vocabulary as a
tiktoken.model, Kimi's special tokens and chat template.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from ember.home import ember_home
from ember.models import tiny_kimi
from ember.tokenizer.tiktoken_bpe import TIKTOKEN_FILE

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")
# The archs of DeepSeek-V3's model (MLA, grouped routing): Kimi K2 is one, under its own model_type.
DEEPSEEK_ARCHS = ("deepseek_v3", "kimi_k2")

HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE_SIZE = 128
NUM_EXPERTS = 8
NUM_EXPERTS_PER_TOK = 2
MOE_INTERMEDIATE_SIZE = 32
MAX_POSITIONS = 2048
ROPE_THETA = 10000.0
# DeepSeek-V3 / Kimi K2 (MLA and grouped routing), at the tiny scale: the first layer dense, then
# MoE layers of 8 routed experts in 4 groups (2 kept, 2 experts a token) and one shared expert.
DEEPSEEK = {
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": NUM_EXPERTS,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": NUM_EXPERTS_PER_TOK,
    "n_shared_experts": 1,
    "moe_intermediate_size": MOE_INTERMEDIATE_SIZE,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_interleave": True,
}

# 3,063 merges-and-bytes plus 9 added tokens gives a full vocabulary of 3,072 = 48 * 64, which
# divides evenly for vocab-parallel tests.
BPE_VOCAB_SIZE = 3063

# (content, special). As in Qwen2.5/Qwen3, only the turn markers are special; the tool and think
# markers must survive decode(skip_special_tokens=True) so parsers can find them in the text.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Modules present in every CPython since 3.9; their source is the tokenizer's training text, so
# the vocabulary is fixed for a given Python version and needs no download.
_CORPUS_MODULES = (
    "argparse",
    "ast",
    "collections",
    "dataclasses",
    "difflib",
    "enum",
    "functools",
    "inspect",
    "json.decoder",
    "json.encoder",
    "pathlib",
    "string",
    "textwrap",
    "typing",
)

# Qwen2's pipeline (NFC, this split, then byte-level). transformers 5 rebuilds the pipeline of any
# model_type "qwen2" checkpoint in code rather than reading tokenizer.json, so any other choice
# would make our tokenizer.json and transformers disagree.
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}
_TIED = {"qwen3": True}

CHAT_TEMPLATE = r"""{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if bos_token is defined and bos_token %}{{- bos_token }}{%- endif %}
{%- set turns = messages %}
{%- set system = none %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system = text(messages[0].content) %}
    {%- set turns = messages[1:] %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system %}{{- system + '\n\n' }}{%- endif %}
    {{- 'Functions you may call are described in JSON inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nTo call functions, reply with one JSON object per call, each wrapped in ' }}
    {{- '<tool_call></tool_call> tags:\n<tool_call>\n' }}
    {{- '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n' }}
    {{- '</tool_call><|im_end|>\n' }}
{%- elif system is not none %}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in turns %}
    {%- if message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content.strip() + '\n</think>\n\n' }}
        {%- endif %}
        {%- set body = text(message.content) %}
        {{- body }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if body or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {#- Consecutive tool results share one user turn. #}
        {%- if loop.first or turns[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
        {%- if loop.last or turns[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unsupported message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


def make_tiny(
    out_dir: str | Path,
    arch: str,
    *,
    seed: int = 0,
    num_shards: int = 1,
    rope_scaling: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random checkpoint of `arch` into `out_dir` and return its path. `overrides`
    replace config fields before the weights are made (deepseek_v3 and kimi_k2: `q_lora_rank`
    None gives a plain q projection, `first_k_dense_replace` the dense layers)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    vocab_size, bos, eos_ids, pad = _write_tokenizer(out, arch)
    generation = {"bos_token_id": bos, "eos_token_id": eos_ids, "pad_token_id": pad}
    config = _config(arch, vocab_size, bos, eos_ids[0], rope_scaling) | (overrides or {})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation)
    # A weight file left from an earlier make with another num_shards would shadow the new ones.
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    _write_weights(out, _weights(arch, config, seed), num_shards)
    return out


def _write_tokenizer(out: Path, arch: str) -> tuple[int, int, list[int], int]:
    """Write the tokenizer files; returns (vocab size, bos id, eos ids, pad id): the chat's end of
    turn first among the eos ids."""
    # A tokenizer file left from an earlier make of another arch would shadow the new one.
    for stale in ("tokenizer.json", TIKTOKEN_FILE):
        (out / stale).unlink(missing_ok=True)
    if arch == "kimi_k2":
        vocab = json.loads(_trained_tokenizer_json())["model"]["vocab"]
        tiny_kimi.write_tiktoken_model(out / TIKTOKEN_FILE, vocab)
        _write_json(out / "tokenizer_config.json", tiny_kimi.tokenizer_config(MAX_POSITIONS))
        ids = tiny_kimi.special_token_ids()
        eos_ids = [ids[tiny_kimi.CHAT_EOS_TOKEN], ids[tiny_kimi.EOS_TOKEN]]
        vocab_size = tiny_kimi.NUM_RANKS + tiny_kimi.NUM_SPECIAL_IDS
        return vocab_size, ids[tiny_kimi.BOS_TOKEN], eos_ids, ids[tiny_kimi.PAD_TOKEN]
    tokenizer = _tokenizer(arch)
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {content: tokenizer.token_to_id(content) for content, _ in ADDED_TOKENS}
    _write_json(out / "tokenizer_config.json", _tokenizer_config(arch, ids))
    eos_ids = [ids[EOS_TOKEN], ids["<|endoftext|>"]]
    return tokenizer.get_vocab_size(), ids[BOS_TOKEN], eos_ids, ids[PAD_TOKEN]


def _tokenizer(arch: str) -> Tokenizer:
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json())
    if arch == "llama":
        # Llama 3 adds its bos in the post-processor; do the same so that path gets tested.
        bos_id = tokenizer.token_to_id(BOS_TOKEN)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
    return tokenizer


@cache
def _trained_tokenizer_json() -> str:
    # Training takes about half a second; the cache makes every later checkpoint free.
    texts = [inspect.getsource(importlib.import_module(name)) for name in _CORPUS_MODULES]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    added = [AddedToken(text, special=special, normalized=False) for text, special in ADDED_TOKENS]
    tokenizer.add_tokens(added)
    return tokenizer.to_str()


def _tokenizer_config(arch: str, ids: dict[str, int]) -> dict[str, Any]:
    added = {
        str(ids[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in ADDED_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN if arch == "llama" else None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


def _config(
    arch: str, vocab_size: int, bos_id: int, eos_id: int, rope_scaling: dict[str, Any] | None
) -> dict[str, Any]:
    # Written as hub checkpoints made before transformers 5 are: `rope_theta` and `rope_scaling` at
    # top level. transformers 5 folds them into `rope_parameters` when it reads them, and older
    # readers never knew `rope_parameters`, so this one spelling serves both.
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_scaling": dict(rope_scaling) if rope_scaling is not None else None,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": _TIED.get(arch, False),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch in DEEPSEEK_ARCHS:
        config.update(DEEPSEEK, num_key_value_heads=NUM_HEADS, attention_bias=False)
        config["head_dim"] = DEEPSEEK["qk_rope_head_dim"]  # as transformers writes it
    elif arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=NUM_LAYERS)
    if arch in ("qwen3", "qwen3_moe"):
        config["attention_bias"] = False
    if arch == "qwen3_moe":
        config.update(
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=NUM_EXPERTS_PER_TOK,
            moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    return config


def _weights(arch: str, config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the on-disk names of real checkpoints, in model order."""
    gen = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps activations near unit scale through every layer.
        std = gain / in_features**0.5
        return torch.randn(out_features, in_features, generator=gen) * std

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    # From the config, so that `overrides` may change the heads (a head dim of 64 or 128 takes
    # the kernels that need one).
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    # The final norm leaves hidden states at unit RMS, so an embedding std of 0.25 gives logits a
    # std of about 0.25 * sqrt(64) = 2: far from the near-ties that make greedy decoding flaky.
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": 0.25 * torch.randn(vocab, hidden, generator=gen)
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        if arch in DEEPSEEK_ARCHS:
            w.update(_deepseek_layer(p, i, config, linear, norm, gen))
            continue
        w[f"{p}.input_layernorm.weight"] = norm(hidden)
        w[f"{p}.self_attn.q_proj.weight"] = linear(q_size, hidden)
        w[f"{p}.self_attn.k_proj.weight"] = linear(kv_size, hidden)
        w[f"{p}.self_attn.v_proj.weight"] = linear(kv_size, hidden)
        if arch == "qwen2":
            w[f"{p}.self_attn.q_proj.bias"] = 0.1 * torch.randn(q_size, generator=gen)
            w[f"{p}.self_attn.k_proj.bias"] = 0.1 * torch.randn(kv_size, generator=gen)
            w[f"{p}.self_attn.v_proj.bias"] = 0.1 * torch.randn(kv_size, generator=gen)
        w[f"{p}.self_attn.o_proj.weight"] = linear(hidden, q_size, gain=0.5)
        if arch in ("qwen3", "qwen3_moe"):
            w[f"{p}.self_attn.q_norm.weight"] = norm(head_dim)
            w[f"{p}.self_attn.k_norm.weight"] = norm(head_dim)
        w[f"{p}.post_attention_layernorm.weight"] = norm(hidden)
        if arch == "qwen3_moe":
            w[f"{p}.mlp.gate.weight"] = linear(NUM_EXPERTS, hidden)
            for e in range(NUM_EXPERTS):
                ep = f"{p}.mlp.experts.{e}"
                w[f"{ep}.gate_proj.weight"] = linear(MOE_INTERMEDIATE_SIZE, hidden)
                w[f"{ep}.up_proj.weight"] = linear(MOE_INTERMEDIATE_SIZE, hidden)
                w[f"{ep}.down_proj.weight"] = linear(hidden, MOE_INTERMEDIATE_SIZE, gain=0.5)
        else:
            w[f"{p}.mlp.gate_proj.weight"] = linear(INTERMEDIATE_SIZE, hidden)
            w[f"{p}.mlp.up_proj.weight"] = linear(INTERMEDIATE_SIZE, hidden)
            w[f"{p}.mlp.down_proj.weight"] = linear(hidden, INTERMEDIATE_SIZE, gain=0.5)
    w["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = 0.25 * torch.randn(vocab, hidden, generator=gen)
    return w


def _deepseek_layer(
    p: str,
    i: int,
    c: dict[str, Any],
    linear: Any,
    norm: Any,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """One DeepSeek-V3 decoder layer under the checkpoints' names: MLA (q through a LoRA of rank
    q_lora_rank, or q_proj; the compressed KV and the shared rope key from kv_a_proj_with_mqa, the
    per-head K and V from kv_b_proj) and a dense MLP or the MoE (router with its correction bias,
    routed experts one by one, shared experts)."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    lora, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    a = f"{p}.self_attn"
    w = {f"{p}.input_layernorm.weight": norm(hidden)}
    if c.get("q_lora_rank"):
        w[f"{a}.q_a_proj.weight"] = linear(c["q_lora_rank"], hidden)
        w[f"{a}.q_a_layernorm.weight"] = norm(c["q_lora_rank"])
        w[f"{a}.q_b_proj.weight"] = linear(heads * qk, c["q_lora_rank"])
    else:
        w[f"{a}.q_proj.weight"] = linear(heads * qk, hidden)
    w[f"{a}.kv_a_proj_with_mqa.weight"] = linear(lora + rope, hidden)
    w[f"{a}.kv_a_layernorm.weight"] = norm(lora)
    w[f"{a}.kv_b_proj.weight"] = linear(heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), lora)
    w[f"{a}.o_proj.weight"] = linear(hidden, heads * c["v_head_dim"], gain=0.5)
    w[f"{p}.post_attention_layernorm.weight"] = norm(hidden)
    m = f"{p}.mlp"
    if i < c["first_k_dense_replace"]:
        w[f"{m}.gate_proj.weight"] = linear(c["intermediate_size"], hidden)
        w[f"{m}.up_proj.weight"] = linear(c["intermediate_size"], hidden)
        w[f"{m}.down_proj.weight"] = linear(hidden, c["intermediate_size"], gain=0.5)
        return w
    inter, experts = c["moe_intermediate_size"], c["n_routed_experts"]
    w[f"{m}.gate.weight"] = linear(experts, hidden)
    w[f"{m}.gate.e_score_correction_bias"] = 0.1 * torch.randn(
        experts, generator=gen, device=gen.device
    )
    for e in range(experts):
        w[f"{m}.experts.{e}.gate_proj.weight"] = linear(inter, hidden)
        w[f"{m}.experts.{e}.up_proj.weight"] = linear(inter, hidden)
        w[f"{m}.experts.{e}.down_proj.weight"] = linear(hidden, inter, gain=0.5)
    shared = inter * c["n_shared_experts"]
    w[f"{m}.shared_experts.gate_proj.weight"] = linear(shared, hidden)
    w[f"{m}.shared_experts.up_proj.weight"] = linear(shared, hidden)
    w[f"{m}.shared_experts.down_proj.weight"] = linear(hidden, shared, gain=0.5)
    return w


def _write_weights(out: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata=metadata)
        return
    if num_shards > len(weights):
        raise ValueError(f"num_shards={num_shards} exceeds the {len(weights)} tensors to shard")
    total = sum(t.numel() * t.element_size() for t in weights.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, (name, tensor) in enumerate(weights.items()):
        # Start the next shard once this one holds its share of bytes, or when every tensor left
        # is needed to keep the remaining shards non-empty.
        shards_after = num_shards - len(shards)
        if (
            shards[-1]
            and shards_after
            and (size >= total / num_shards or len(weights) - k <= shards_after)
        ):
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.numel() * tensor.element_size()
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, str(out / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def default_tiny_dir(arch: str = "qwen3") -> Path:
    """Where `ember demo`, `ember up` and the benchmarks keep the embedded tiny models."""
    home = ember_home()
    return home / "models" / f"tiny-{arch}"


def ensure_tiny(arch: str = "qwen3") -> Path:
    """The tiny `arch` model in `default_tiny_dir`, made there on first use."""
    out = default_tiny_dir(arch)
    if not (out / "config.json").is_file():
        print(f"making the tiny {arch} model in {out} ...", file=sys.stderr)
        make_tiny(out, arch)
    return out
