"""The training-time test of scripts/train_eagle3.py (EAGLE-3): the draft chain unrolled K steps
over whole sequences at once, as `Eagle3Drafter.propose` runs it, step j's row p attending to
step 0's keys of positions <= p and to its own keys of steps 1..j."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ember.spec_decode.eagle3 import Eagle3DraftModel


def ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """q [B, S, Hq, D] of step j = len(keys) - 1: causal over step 0's keys, plus each row's own
    keys of steps 1..j (the chain's later positions)."""
    b, s, hq, d = q.shape
    rep = hq // keys[0].shape[2]
    expand = [
        (k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2))
        for k, v in zip(keys, values, strict=True)
    ]
    qt = q.transpose(1, 2).float()  # [B, Hq, S, D]
    k0, v0 = (t.transpose(1, 2).float() for t in expand[0])
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = [(qt @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    scores += [
        ((q.float() * k.float()).sum(-1) * scale).transpose(1, 2)[..., None] for k, _ in expand[1:]
    ]
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :s] @ v0
    for i, (_, v) in enumerate(expand[1:]):
        out = out + probs[..., s + i : s + i + 1] * v.transpose(1, 2).float()
    return out.transpose(1, 2).to(q.dtype)


def shift(x: torch.Tensor, n: int, fill: int | bool) -> torch.Tensor:
    """x[:, p + n] at p, `fill` past the end."""
    return torch.cat([x[:, n:], x.new_full((x.shape[0], n), fill)], dim=1)


def ttt_forward(
    model: Eagle3DraftModel,
    ids: torch.Tensor,
    aux: torch.Tensor,
    labels: torch.Tensor,
    answer: torch.Tensor,
    steps: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """labels: draft ids, -1 outside the draft vocabulary; answer: `in_answer` per row. Per step:
    the loss, and each row's correctness [B, S] (False where the label is not scored)."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    b, s = ids.shape
    hidden = model.fc(aux)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    losses, correct = [], []
    for j in range(steps):
        tok, lab = shift(ids, 1 + j, 0), shift(labels, 1 + j, -1)
        m = shift(answer, 1 + j, False) & (lab >= 0)
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(model.embed_tokens(tok)), normed], dim=-1)
        q, k, v = attn.qkv_proj.split(attn.qkv_proj(x))
        q = q.reshape(b * s, attn.num_heads, attn.head_dim)
        k = k.reshape(b * s, attn.num_kv_heads, attn.head_dim)
        pos = (torch.arange(s, device=ids.device) + j).repeat(b)
        q, k = attn.rotary(pos, q, k)
        keys.append(k.reshape(b, s, attn.num_kv_heads, attn.head_dim))
        values.append(v.reshape(b, s, attn.num_kv_heads, attn.head_dim))
        o = ttt_attention(q.reshape(b, s, attn.num_heads, attn.head_dim), keys, values, attn.scale)
        x, residual = layer.post_attention_layernorm(attn.o_proj(o.reshape(b, s, -1)), residual)
        hidden = layer.mlp(x) + residual
        logits = model.compute_logits(hidden)
        losses.append(F.cross_entropy(logits[m], lab[m]) if m.any() else logits.sum() * 0)
        correct.append((logits.argmax(-1) == lab) & m)
    return losses, correct
