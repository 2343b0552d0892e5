"""EAGLE-3 draft heads: the published checkpoint layout loads (and wrong ones are refused by name),
the draft layer matches a plain-PyTorch reference, drafting over the paged KV is deterministic and
consistent across calls, the target hands out the right hidden states, and the training script
writes a head that loads."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.attention.torch_backend import TorchAttentionBackend
from ember.engine.model_runner import kv_cache_shape
from ember.models.loader import load_model
from ember.spec_decode.eagle3 import DraftRow, Eagle3Drafter, default_aux_layers, load_eagle3

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4


def write_head(
    out: Path,
    target_dir: Path,
    *,
    seed: int = 0,
    draft_vocab: int = 200,
    config: dict | None = None,
    weights: dict | None = None,
) -> Path:
    """A random head in the published layout for the target in `target_dir`; `config` and
    `weights` override (a value of None deletes the entry)."""
    t = json.loads((target_dir / "config.json").read_text())
    h, heads, kv, hd = (
        t["hidden_size"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        t["head_dim"],
    )
    inter, vocab = t["intermediate_size"], t["vocab_size"]
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "torch_dtype": "float32",
    }
    g = torch.Generator().manual_seed(seed)

    def lin(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) / i**0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    w = {
        "fc.weight": lin(h, 3 * h),
        "midlayer.input_layernorm.weight": norm(h),
        "midlayer.hidden_norm.weight": norm(h),
        "midlayer.self_attn.q_proj.weight": lin(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": lin(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": lin(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": lin(h, heads * hd),
        "midlayer.post_attention_layernorm.weight": norm(h),
        "midlayer.mlp.gate_proj.weight": lin(inter, h),
        "midlayer.mlp.up_proj.weight": lin(inter, h),
        "midlayer.mlp.down_proj.weight": lin(h, inter),
        "norm.weight": norm(h),
        "lm_head.weight": 4 * lin(draft_vocab, h),
        "d2t": draft_ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    for src, over in ((cfg, config), (w, weights)):
        for k, v in (over or {}).items():
            if v is None:
                src.pop(k, None)
            else:
                src[k] = v
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def head_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("head"), target_dir)


@pytest.fixture
def target(target_dir: Path) -> torch.nn.Module:
    return load_model(target_dir, dtype=torch.float32)


def make_drafter(head_dir: Path, target: torch.nn.Module, num_blocks: int = 32) -> Eagle3Drafter:
    d = Eagle3Drafter(
        str(head_dir), target, BLOCK, torch.float32, torch.device("cpu"), TorchAttentionBackend()
    )
    d.allocate_kv_cache(num_blocks)
    return d


# -- loading ---------------------------------------------------------------------------------------


def test_published_layout_loads(head_dir: Path, target: torch.nn.Module) -> None:
    model = load_eagle3(head_dir, target, torch.float32, "cpu")
    assert model.embed_tokens is target.model.embed_tokens  # the target's table, not a copy
    written = load_file(str(head_dir / "model.safetensors"))
    qkv = model.midlayer.self_attn.qkv_proj.weight
    q = written["midlayer.self_attn.q_proj.weight"]
    assert torch.equal(qkv[: q.shape[0]], q)
    assert torch.equal(
        qkv[-written["midlayer.self_attn.v_proj.weight"].shape[0] :],
        written["midlayer.self_attn.v_proj.weight"],
    )
    assert torch.equal(model.d2t, written["d2t"])
    # Written back under the published names, every tensor is the one that was read.
    back = model.published_weights()
    assert sorted(back) == sorted(written)
    for name, tensor in written.items():
        assert torch.equal(back[name], tensor), name


def test_own_embedding_is_used(target_dir: Path, target: torch.nn.Module, tmp_path: Path) -> None:
    table = torch.randn(target.config.vocab_size, target.config.hidden_size)
    d = write_head(tmp_path, target_dir, weights={"embed_tokens.weight": table})
    model = load_eagle3(d, target, torch.float32, "cpu")
    assert model.embed_tokens is not target.model.embed_tokens
    assert torch.equal(model.embed_tokens.weight, table)


def _bad_d2t(vocab: int) -> torch.Tensor:
    d2t = torch.zeros(200, dtype=torch.int64)
    d2t[-1] = vocab  # draft id 199 -> target id vocab + 199
    return d2t


@pytest.mark.parametrize(
    "config,weights,match",
    [
        ({"architectures": ["LlamaForCausalLM"]}, None, "not an EAGLE-3 head"),
        ({"num_hidden_layers": 2}, None, "one decoder layer"),
        (
            {"vocab_size": 1000, "draft_vocab_size": 200},
            {"t2d": torch.zeros(1000, dtype=torch.bool)},
            "vocab_size 1000",
        ),
        ({"target_hidden_size": 32}, {"fc.weight": torch.zeros(64, 96)}, "target_hidden_size 32"),
        ({"hidden_size": 32, "target_hidden_size": 64}, None, "no embed_tokens.weight"),
        ({"draft_vocab_size": 5000}, None, "draft_vocab_size 5000"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, None, "3 layer ids"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}, None, r"layers \[9\]"),
        (None, {"d2t": torch.zeros(7, dtype=torch.int64)}, "'d2t' has shape"),
        (None, {"t2d": torch.zeros(7, dtype=torch.bool)}, "'t2d' has shape"),
        (None, {"fc.weight": torch.zeros(64, 64)}, "'fc.weight' has shape"),
        (
            None,
            {"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)},
            "'midlayer.self_attn.q_proj.weight' has shape",
        ),
        (None, {"lm_head.weight": None}, "lacks weights.*lm_head"),
        (
            None,
            {"midlayer.self_attn.v_proj.weight": None},
            r"lacks parts of weights.*qkv_proj\.weight \(v\)",
        ),
        (None, {"midlayer.mlp.up_proj.weight": None}, r"gate_up_proj\.weight \(up\)"),
        (None, {"midlayer.extra.weight": torch.zeros(3)}, "'midlayer.extra.weight'"),
        (None, {"d2t": None}, "needs a d2t map"),
        (None, {"d2t": "BAD"}, "outside the target vocabulary"),
    ],
)
def test_wrong_checkpoints_are_refused_by_name(
    target_dir: Path, target: torch.nn.Module, tmp_path: Path, config, weights, match: str
) -> None:
    if weights and isinstance(weights.get("d2t"), str):
        weights = {"d2t": _bad_d2t(target.config.vocab_size)}
    d = write_head(tmp_path, target_dir, config=config, weights=weights)
    with pytest.raises(ValueError, match=match):
        load_eagle3(d, target, torch.float32, "cpu")


# -- the draft layer against a plain reference --------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    f = pos[:, None].float() * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def reference_layer(
    w: dict[str, torch.Tensor], embeds: torch.Tensor, hidden: torch.Tensor, heads: int, kv: int
) -> torch.Tensor:
    """The EAGLE-3 layer over a whole sequence, dense causal attention, no cache: the output before
    the final norm (hidden [T, H] already through fc)."""
    t = hidden.shape[0]
    x = torch.cat(
        [
            _rms(embeds, w["midlayer.input_layernorm.weight"]),
            _rms(hidden, w["midlayer.hidden_norm.weight"]),
        ],
        -1,
    )
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, heads, -1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, kv, -1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, kv, -1)
    pos = torch.arange(t)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    r = hidden + o @ w["midlayer.self_attn.o_proj.weight"].T
    y = _rms(r, w["midlayer.post_attention_layernorm.weight"])
    mlp = (
        F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)
    ) @ w["midlayer.mlp.down_proj.weight"].T
    return r + mlp


def reference_drafts(
    w: dict[str, torch.Tensor],
    target: torch.nn.Module,
    tokens: list[int],
    aux: torch.Tensor,
    k: int,
) -> list[int]:
    """Greedy chain by recomputing the whole sequence each step: the chained position's input is
    (the last draft, the layer's own output at the previous position)."""
    heads, kv = target.config.num_attention_heads, target.config.num_key_value_heads
    embed = target.model.embed_tokens.weight
    hidden = aux @ w["fc.weight"].T
    toks = list(tokens)
    out = []
    for _ in range(k):
        y = reference_layer(w, embed[torch.tensor(toks)], hidden, heads, kv)
        logits = _rms(y[-1], w["norm.weight"]) @ w["lm_head.weight"].T
        d = int(logits.argmax())
        d += int(w["d2t"][d])
        out.append(d)
        toks.append(d)
        hidden = torch.cat([hidden, y[-1:]])
    return out


def _weights(head_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(head_dir / "model.safetensors"))


def test_forward_matches_reference(head_dir: Path, target: torch.nn.Module) -> None:
    drafter = make_drafter(head_dir, target)
    model, w = drafter.model, _weights(head_dir)
    g = torch.Generator().manual_seed(1)
    n, h = 11, target.config.hidden_size
    tokens = torch.randint(0, target.config.vocab_size, (n,), generator=g)
    aux = torch.randn(n, 3 * h, generator=g)
    blocks = [5, 2, 9]
    slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    with torch.no_grad():
        ctx = ForwardContext(md, drafter.kv_cache, drafter.backend)
        got = model(tokens, torch.arange(n), model.fc(aux), ctx)
        want = reference_layer(
            w,
            target.model.embed_tokens.weight[tokens],
            aux @ w["fc.weight"].T,
            target.config.num_attention_heads,
            target.config.num_key_value_heads,
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        logits = _rms(want, w["norm.weight"]) @ w["lm_head.weight"].T
        torch.testing.assert_close(model.compute_logits(got), logits, atol=1e-5, rtol=1e-5)


# -- drafting -----------------------------------------------------------------------------------------


def _sequence(target: torch.nn.Module, n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist()
    return tokens, torch.randn(n, 3 * target.config.hidden_size, generator=g)


def test_propose_matches_reference_chain(head_dir: Path, target: torch.nn.Module) -> None:
    drafter = make_drafter(head_dir, target)
    tokens, aux = _sequence(target, 9, seed=2)
    got = drafter.propose([DraftRow([3, 7, 1], 0, tokens, aux)], k=4)
    assert got == [reference_drafts(_weights(head_dir), target, tokens, aux, 4)]


def test_propose_is_deterministic_batched_and_in_vocab(
    head_dir: Path, target: torch.nn.Module
) -> None:
    drafter = make_drafter(head_dir, target)
    vocab = set((torch.arange(200) + drafter.model.d2t).tolist())
    seqs = [_sequence(target, n, seed=10 + n) for n in (6, 1, 9)]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    # Each row continues a sequence whose earlier positions (before `start`) are already cached.
    starts = [0, 4, 2]
    for table, start in zip(tables, starts, strict=True):
        if start:
            pre, pre_aux = _sequence(target, start, seed=start)
            drafter.propose([DraftRow(table, 0, pre, pre_aux)], k=1)
    rows = [
        DraftRow(t, s, toks, aux) for (toks, aux), t, s in zip(seqs, tables, starts, strict=True)
    ]
    first = drafter.propose(rows, k=3)
    assert [len(r) for r in first] == [3, 3, 3]
    assert all(d in vocab for r in first for d in r)
    assert drafter.propose(rows, k=3) == first  # same context, same drafts
    assert [drafter.propose([r], k=3)[0] for r in rows] == first  # batching changes nothing


def test_second_call_continues_where_verification_left_off(
    head_dir: Path, target: torch.nn.Module
) -> None:
    tokens, aux = _sequence(target, 14, seed=3)
    whole = make_drafter(head_dir, target).propose([DraftRow([4, 0, 6, 2], 0, tokens, aux)], k=3)
    split = make_drafter(head_dir, target)
    table = [1, 7, 3, 5]
    # A prefill chunk writes its KV and drafts nothing (k = 0).
    assert split.propose([DraftRow(table, 0, tokens[:5], aux[:5])], k=0) == [[]]
    # The next call drafts from position 8 and writes draft KV at 9 and 10; verification then
    # accepted some tokens, and the last call rewrites positions 9.. with the target's states.
    split.propose([DraftRow(table, 5, tokens[5:9], aux[5:9])], k=3)
    again = split.propose([DraftRow(table, 9, tokens[9:], aux[9:])], k=3)
    assert again == whole


def test_propose_refuses_rows_it_cannot_hold(head_dir: Path, target: torch.nn.Module) -> None:
    drafter = make_drafter(head_dir, target)
    tokens, aux = _sequence(target, 7, seed=4)
    with pytest.raises(ValueError, match="past the row's 2 blocks"):
        drafter.propose([DraftRow([0, 1], 0, tokens, aux)], k=3)  # positions up to 8 > 7
    with pytest.raises(ValueError, match="aux hidden rows"):
        drafter.propose([DraftRow([0, 1, 2], 0, tokens, aux[:3])], k=1)


# -- the target's aux hidden states ---------------------------------------------------------------------


def _target_forward(target: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    n = len(ids)
    nb = -(-n // BLOCK)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([list(range(nb))], dtype=torch.int32),
        slot_mapping=torch.arange(n),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    kv = torch.zeros(kv_cache_shape(target.config, nb, BLOCK))
    with torch.no_grad():
        return target(ids, torch.arange(n), ForwardContext(md, kv, TorchAttentionBackend()))


def test_target_aux_hidden_matches_hooks(target: torch.nn.Module) -> None:
    ids = torch.randint(
        0, target.config.vocab_size, (10,), generator=torch.Generator().manual_seed(5)
    )
    plain = _target_forward(target, ids)
    assert target.model.aux_hidden is None  # nothing is kept unless asked for
    layers = target.config.num_hidden_layers
    assert default_aux_layers(layers) == (2, 1, 0)  # clamped for a 2-layer target
    assert default_aux_layers(32) == (2, 16, 29)
    stream: dict[int, torch.Tensor] = {}
    hooks = [
        target.model.embed_tokens.register_forward_hook(
            lambda m, a, out: stream.__setitem__(0, out)
        )
    ]
    for i, layer in enumerate(target.model.layers):
        # A layer returns (its output, the residual before it): their sum is the stream after it.
        hooks.append(
            layer.register_forward_hook(
                lambda m, a, out, i=i: stream.__setitem__(i + 1, out[0] + out[1])
            )
        )
    target.model.aux_layers = (2, 1, 0)
    try:
        hidden = _target_forward(target, ids)
    finally:
        for hk in hooks:
            hk.remove()
    torch.testing.assert_close(hidden, plain, atol=0, rtol=0)  # the output is untouched
    want = torch.cat([stream[2], stream[1], stream[0]], dim=-1)
    torch.testing.assert_close(target.model.aux_hidden, want, atol=1e-6, rtol=1e-6)


def test_drafter_sets_the_targets_aux_layers(head_dir: Path, target: torch.nn.Module) -> None:
    drafter = make_drafter(head_dir, target)
    assert drafter.aux_layers == (2, 1, 0)
    assert target.model.aux_layers == drafter.aux_layers


# -- training ----------------------------------------------------------------------------------------


def test_train_script_writes_a_loadable_head(
    target_dir: Path, target: torch.nn.Module, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"kind": "chat", "messages": [{"role": "user", "content": c}]}) + "\n"
            for c in ("def add(a, b):", "import json", "class Path:")
        )
    )
    out = tmp_path / "head"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "train_eagle3.py"),
        "--model",
        str(target_dir),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
        "--samples",
        "1",
        "--max-steps",
        "2",
        "--draft-vocab-size",
        "300",
        "--ttt-steps",
        "2",
        "--log-every",
        "1",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["train_sequences"] == 2 and summary["eval_sequences"] == 1
    assert summary["steps"] == 2 and summary["draft_vocab_size"] == 300
    assert len(summary["step_accuracy"]) == 2
    assert summary["mean_accepted_length"] >= 1
    drafter = make_drafter(out, target)
    tokens, aux = _sequence(target, 5, seed=6)
    drafts = drafter.propose([DraftRow([0, 1, 2], 0, tokens, aux)], k=2)
    assert len(drafts[0]) == 2 and all(0 <= d < target.config.vocab_size for d in drafts[0])


def test_kv_block_bytes_is_what_a_block_of_its_cache_takes(
    head_dir: Path, target: torch.nn.Module
) -> None:
    d = make_drafter(head_dir, target, num_blocks=5)
    assert d.kv_block_bytes * 5 == d.kv_cache.numel() * d.kv_cache.element_size()
