"""The token embedding and the LM head split by vocabulary across tensor-parallel ranks.

Rank r holds the contiguous ids [r * per_rank, (r + 1) * per_rank), per_rank = ceil(vocab /
size). A vocabulary the ranks do not divide is padded, not refused: published vocabularies such
as 32001 or 50257 divide by no GPU count, and padding costs at most size - 1 rows. The padding
rows (on the last ranks) hold zeros, no id looks them up, and their logits are trimmed before
anything reads them. On one rank there is no padding and both layers are the plain ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import comm
from ember.distributed.state import current
from ember.models.layers.linear import Linear, make_linear, quant_scheme
from ember.models.quant_config import QuantConfig


class VocabShard:
    """This rank's ids [start, end) of `vocab_size`, held in `per_rank` rows (end - start of
    them the checkpoint's, the rest padding)."""

    def __init__(self, vocab_size: int) -> None:
        s = current()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // s.size)
        self.start = min(s.rank * self.per_rank, vocab_size)
        self.end = min(self.start + self.per_rank, vocab_size)
        self.parallel = s.size > 1

    def load(self, param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
        """Copy this rank's rows of `loaded` ([vocab_size, dim], the checkpoint's whole tensor)
        into `param`, and zeros into its padding rows."""
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"weight {name!r} has shape {tuple(loaded.shape)} in the checkpoint, "
                f"the model expects {expected}"
            )
        n = self.end - self.start
        with torch.no_grad():
            param.data[:n].copy_(loaded[self.start : self.end])
            param.data[n:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding of this rank's `vocab` rows: ids outside them look up zeros, and the ranks'
    lookups are summed (each id is some one rank's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, name: str = "embed_tokens") -> None:
        vocab = VocabShard(num_embeddings)
        super().__init__(vocab.per_rank, embedding_dim)
        self.vocab = vocab
        self.name = name

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        v = self.vocab
        if not v.parallel:
            return super().forward(input_ids)
        local = input_ids - v.start
        outside = (local < 0) | (local >= v.end - v.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return comm.all_reduce(x)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str = "") -> None:
        self.vocab.load(param, loaded, f"{self.name}.weight")


class ParallelLMHead(Linear):
    """The LM head's `Linear` over this rank's `vocab` rows: its logits are this rank's slice,
    which `gather_logits` makes whole. Tied to the embedding, it shares the embedding's rows."""

    def __init__(self, hidden_size: int, vocab_size: int, name: str = "lm_head") -> None:
        vocab = VocabShard(vocab_size)
        super().__init__(hidden_size, vocab.per_rank, bias=False)
        self.vocab = vocab
        self.name = name

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str = "") -> None:
        self.vocab.load(param, loaded, f"{self.name}.weight")


def make_lm_head(
    hidden_size: int,
    vocab_size: int,
    quant: QuantConfig | None,
    tied: VocabParallelEmbedding | None = None,
    name: str = "lm_head",
) -> nn.Module:
    """The LM head: `ParallelLMHead` (sharing `tied`'s weight if given), or the column-parallel
    `QuantLinear` of a quantized one. That one holds the checkpoint's rows unpadded and the
    gather needs equal slices, so a vocabulary the ranks do not divide is refused for it
    (`make_linear` names lm_head's rows); quantized LM heads are rare enough not to pad."""
    if tied is None and quant_scheme(quant, [name]) is not None:
        return make_linear(hidden_size, vocab_size, quant, name, parallel="column")
    head = ParallelLMHead(hidden_size, vocab_size, name)
    if tied is not None:
        head.weight = tied.weight
    return head


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's logits [..., vocab_size] from each one's slice (the LM head's output):
    gathered in rank order and the padding trimmed. On one rank, `local` itself."""
    if current().group is None:
        return local
    return comm.all_gather(local, dim=-1)[..., :vocab_size]
