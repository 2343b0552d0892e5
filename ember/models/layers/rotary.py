"""Rotary position embeddings (NeoX half-rotation, as Llama and Qwen use), with llama3 scaling and
YaRN (DeepSeek-V3 and Kimi K2: `rope_scaling` of type "yarn" with `mscale`/`mscale_all_dim`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ember.kernels.dispatch import use_triton


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if rope_type(scaling) == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_type(scaling: dict[str, Any]) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (Peng et al. 2023): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (slowed by `factor`), those turning more than `beta_fast`
    times kept, a linear ramp between."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (1 otherwise): `attention_factor` if given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (DeepSeek), else
    mscale(factor)."""
    if scaling is None or rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    return yarn_mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        attention_factor = rope_attention_factor(scaling)
        self.register_buffer("cos_cache", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_factor, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        interleaved: bool = False,
        q_out: torch.Tensor | None = None,
        k_out: torch.Tensor | None = None,
        kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T]. `interleaved`: the rotation pairs sit
        side by side (DeepSeek's `rope_interleave`); the results come deinterleaved, in halves.
        `q_out`/`k_out` (any strides) receive the results when given. `kv_write` = (one layer's
        KV cache, v, slot_mapping): the Triton rotation also writes the rotated k and v into
        their slots (ember/kernels/rotary.py); Triton only."""
        if use_triton(q):
            from ember.kernels.rotary import apply_rotary

            cache, v, slots = kv_write if kv_write is not None else (None, None, None)
            return apply_rotary(
                q,
                k,
                positions,
                self.cos_cache,
                self.sin_cache,
                interleaved=interleaved,
                q_out=q_out,
                k_out=k_out,
                kv_cache=cache,
                v=v,
                slot_mapping=slots,
            )
        if kv_write is not None:
            raise ValueError("kv_write needs the Triton rotation")
        if interleaved:
            q, k = deinterleave(q), deinterleave(k)
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        q_rot = (q.float() * cos + rotate_half(q.float()) * sin).to(q.dtype)
        k_rot = (k.float() * cos + rotate_half(k.float()) * sin).to(k.dtype)
        if q_out is not None:
            q_rot = q_out.copy_(q_rot)
        if k_out is not None:
            k_rot = k_out.copy_(k_rot)
        return q_rot, k_rot


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope dims stored interleaved (x0, y0, x1, y1, ...) into halves (x0, x1, ..., y0, y1, ...),
    so that the NeoX rotation applies: DeepSeek's checkpoints rotate pairs (`rope_interleave`)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
