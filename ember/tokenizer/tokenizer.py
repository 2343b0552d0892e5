"""A model's tokenizer: text <-> token ids, special token ids and the chat template.

Loads a Hugging Face model directory (tokenizer.json, tokenizer_config.json, generation_config.json)
with the `tokenizers` library alone, matching what transformers' fast tokenizer produces. A directory
with a tiktoken.model in place of tokenizer.json (Kimi) has it converted to the same kind of BPE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from ember.tokenizer.chat_template import render_chat_template
from ember.tokenizer.tiktoken_bpe import TIKTOKEN_FILE, cached_tokenizer_from_tiktoken

# The named special tokens transformers passes to chat templates (`bos_token`, ...).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` plus the special tokens and chat template beside it."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | dict[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._config = config or {}
        self._special_tokens = _special_tokens(self._config)
        self._chat_templates = _chat_templates(chat_template or self._config.get("chat_template"))
        self._bos_token_id = self._id_of(self._special_tokens.get("bos_token"))
        self._pad_token_id = self._id_of(self._special_tokens.get("pad_token"))
        self._eos_token_ids = self._eos_ids(generation_config or {})
        # What decode(skip_special_tokens=True) drops: the added tokens flagged special.
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a model directory; tokenizer.json (or tiktoken.model) is required, the rest
        optional."""
        root = Path(path)
        config = _read_json(root / "tokenizer_config.json")
        template_file = root / "chat_template.jinja"
        # As in transformers, a chat_template.jinja file wins over the tokenizer_config entry.
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(
            load_backend(root, config),
            config=config,
            generation_config=_read_json(root / "generation_config.json"),
            chat_template=template,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json exists: bos
        # comes only from tokenizer.json's post-processor, which the backend applies here too.
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization_spaces: transformers 5 skips it for BPE, as it mangles text.
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (what transformers' len(tokenizer) returns)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None when the model ships none."""
        return self._chat_templates.get("default")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render the conversation into a prompt; encode it with add_special_tokens=False."""
        template = self._chat_templates.get("tool_use") if tools is not None else None
        template = template or self._chat_templates.get("default")
        if template is None:
            raise ValueError(
                "this model has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja)"
            )
        # Caller kwargs override the special tokens, as in transformers.
        variables = {**self._special_tokens, **kwargs}
        return render_chat_template(template, messages, tools, add_generation_prompt, **variables)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _eos_ids(self, generation_config: dict[str, Any]) -> frozenset[int]:
        ids = generation_config.get("eos_token_id")
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        eos = self._id_of(self._special_tokens.get("eos_token"))
        return frozenset(ids + ([eos] if eos is not None else []))


def load_backend(
    model_dir: str | Path, config: dict[str, Any] | None = None
) -> tokenizers.Tokenizer:
    """A model directory's `tokenizers` tokenizer: its tokenizer.json, or else its tiktoken.model
    with the added tokens of `config` (its tokenizer_config.json, read when not given)."""
    root = Path(model_dir)
    if (root / "tokenizer.json").is_file():
        return tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    if (root / TIKTOKEN_FILE).is_file():
        config = _read_json(root / "tokenizer_config.json") if config is None else config
        return cached_tokenizer_from_tiktoken(
            root / TIKTOKEN_FILE, config.get("added_tokens_decoder") or {}
        )
    raise FileNotFoundError(f"no tokenizer.json (nor {TIKTOKEN_FILE}) in {root}")


def tokenizer_json(model_dir: str | Path) -> str:
    """The model's tokenizer as tokenizer.json text (what llguidance reads); "" if it has none."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    try:
        return load_backend(model_dir).to_str()
    except FileNotFoundError:
        return ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """Named special tokens from tokenizer_config, as strings.

    transformers 5 treats any other `*_token` key holding a token (e.g. `image_token`) as a named
    special token too, and hands all of them to the chat template.
    """
    tokens = {}
    for key, value in config.items():
        if key not in _NAMED_SPECIAL_TOKENS and not key.endswith("_token"):
            continue
        # Older configs serialise tokens as AddedToken dicts.
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            value = value["content"]
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _chat_templates(raw: str | dict[str, str] | list[dict[str, str]] | None) -> dict[str, str]:
    """Named templates: "default", and "tool_use" where the model has a separate one for tools."""
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        # Older tokenizer_configs list templates as [{"name": ..., "template": ...}].
        return {t["name"]: t["template"] for t in raw}
    return dict(raw)
