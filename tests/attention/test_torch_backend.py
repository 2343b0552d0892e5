"""The paged reference against dense causal attention on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.attention.metadata import AttentionMetadata
from ember.attention.torch_backend import TorchAttentionBackend, gather_kv


def dense_reference(q, k, v, q_len, scale):
    """q: [q_len, Hq, D] for the last q_len positions of k/v: [L, Hkv, D]."""
    L = k.shape[0]
    mask = torch.ones(q_len, L, dtype=torch.bool).tril(diagonal=L - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_paged_matches_dense(seed: int, heads: int, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(seed)
    block, dim, num_blocks = 4, 16, 64
    # (cached context, new tokens): decode, extend over a prefix, fresh prefill.
    shapes = [(7, 1), (9, 6), (0, 11), (16, 1)]
    cache = torch.zeros(num_blocks, 2, block, kv_heads, dim)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    ks, vs, qs, tables, slots = [], [], [], [], []
    qsl, seq_lens = [0], []
    for ctx, new in shapes:
        total = ctx + new
        nb = -(-total // block)
        table = [perm.pop() for _ in range(nb)]
        k = torch.randn(total, kv_heads, dim, generator=g)
        v = torch.randn(total, kv_heads, dim, generator=g)
        for p in range(ctx):  # the cached prefix is already in the cache
            cache[table[p // block], 0, p % block] = k[p]
            cache[table[p // block], 1, p % block] = v[p]
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(new, heads, dim, generator=g))
        tables.append(table)
        slots += [table[p // block] * block + p % block for p in range(ctx, total)]
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
    width = max(len(t) for t in tables)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        max_query_len=max(n for _, n in shapes),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, shapes, strict=True)])
    scale = dim**-0.5
    out = TorchAttentionBackend().forward(torch.cat(qs), new_k, new_v, cache, md, scale)
    for i, (ctx, new) in enumerate(shapes):
        # The cache now holds every token of each sequence.
        k_got, v_got = gather_kv(cache, md.block_tables[i], ctx + new)
        torch.testing.assert_close(k_got, ks[i])
        torch.testing.assert_close(v_got, vs[i])
        want = dense_reference(qs[i], ks[i], vs[i], new, scale)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], want, atol=1e-5, rtol=1e-5)
