"""Kimi K2's tokenizer conventions for the tiny `kimi_k2` checkpoint, laid out as
moonshotai/Kimi-K2-Instruct publishes them: a tiktoken vocabulary (`tiktoken.model`) and no
tokenizer.json, the special tokens after the ranks in tokenizer_config's `added_tokens_decoder`,
and Kimi's chat template (`<|im_user|>user<|im_middle|>...<|im_end|>`, tool calls as
`functions.NAME:IDX` in a `<|tool_calls_section_begin|>` section).

Kimi's own tokenizer is Python code run with trust_remote_code (tokenization_kimi.py); it is not
shipped, so tokenizer_config has no `auto_map` to it.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from ember.tokenizer.byte_level import bytes_to_unicode

# The base vocabulary keeps the first 3,056 ranks of the trained tiny BPE: with the 16 ids after
# it the vocabulary is 3,072 = 48 * 64, as the other tiny models' (vocab-parallel tests).
NUM_RANKS = 3056
# Kimi's special tokens in Kimi's order after the ranks, packed into 16 ids (Kimi has 256): as in
# Kimi, reserved ids sit among them (tokenizer_config leaves them out; a loader names them
# `<|reserved_token_ID|>`), `<|im_middle|>` comes after one, and `[UNK]` and `[PAD]` come last.
SPECIAL_TOKENS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|im_system|>": 6,
    "<|tool_calls_section_begin|>": 7,
    "<|tool_calls_section_end|>": 8,
    "<|tool_call_begin|>": 9,
    "<|tool_call_argument_begin|>": 10,
    "<|tool_call_end|>": 11,
    "<|im_middle|>": 13,
    "[UNK]": 14,
    "[PAD]": 15,
}
NUM_SPECIAL_IDS = 16
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "[BOS]", "[EOS]", "[PAD]", "[UNK]"
CHAT_EOS_TOKEN = "<|im_end|>"
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Every turn is `<|im_{user,assistant,system}|>NAME<|im_middle|>BODY<|im_end|>` with NAME the
# message's name or role; tools and tool results are system-class turns. Tool calls keep the id
# the model gave them (`functions.NAME:IDX`), which the tool result quotes back.
CHAT_TEMPLATE = r"""{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_system|>tool_declare<|im_middle|>' -}}
    {{- tools | tojson(separators=(',', ':')) -}}
    {{- '<|im_end|>' -}}
{%- endif -%}
{%- if not messages or messages[0].role != 'system' -%}
    {{- '<|im_system|>system<|im_middle|>DEFAULT_SYSTEM_PROMPT<|im_end|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set name = message.name or message.role -%}
    {%- if message.role == 'user' -%}
        {{- '<|im_user|>' ~ name ~ '<|im_middle|>' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_assistant|>' ~ name ~ '<|im_middle|>' -}}
    {%- else -%}
        {{- '<|im_system|>' ~ name ~ '<|im_middle|>' -}}
    {%- endif -%}
    {%- if message.role == 'tool' -%}
        {{- '## Return of ' ~ (message.tool_call_id or '') ~ '\n' -}}
    {%- endif -%}
    {{- text(message.content) -}}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {{- '<|tool_calls_section_begin|>' -}}
        {%- for call in message.tool_calls -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- set call_id = call.id or 'functions.' ~ fn.name ~ ':' ~ loop.index0 -%}
            {{- '<|tool_call_begin|>' ~ call_id ~ '<|tool_call_argument_begin|>' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '<|tool_call_end|>' -}}
        {%- endfor -%}
        {{- '<|tool_calls_section_end|>' -}}
    {%- endif -%}
    {{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- endif -%}
""".replace("DEFAULT_SYSTEM_PROMPT", DEFAULT_SYSTEM_PROMPT)


def special_token_ids() -> dict[str, int]:
    """Each special token's id: after the NUM_RANKS ranks, at its offset."""
    return {content: NUM_RANKS + offset for content, offset in SPECIAL_TOKENS.items()}


def write_tiktoken_model(path: Path, vocab: dict[str, int]) -> None:
    """Write the byte-level BPE `vocab`'s first NUM_RANKS tokens as a tiktoken file: a token's
    rank is its id, which is its merge order, so tiktoken merges as the BPE does."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = sorted((rank, token) for token, rank in vocab.items() if rank < NUM_RANKS)
    if [rank for rank, _ in ranks] != list(range(NUM_RANKS)):
        raise ValueError(f"the vocabulary lacks some of the ranks 0..{NUM_RANKS - 1}")
    lines = (
        base64.b64encode(bytes(byte_of[c] for c in token)) + b" %d\n" % rank
        for rank, token in ranks
    )
    path.write_bytes(b"".join(lines))


def tokenizer_config(max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by id, the named ones, the chat template."""
    added = {
        str(i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for content, i in special_token_ids().items()
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
        ],
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "tokenizer_class": "TikTokenTokenizer",
        "chat_template": CHAT_TEMPLATE,
    }
