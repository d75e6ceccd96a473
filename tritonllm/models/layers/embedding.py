"""Token embedding and the output projection to vocabulary logits (optionally sharing the embedding matrix).

Under tensor parallelism both split the vocabulary: it is padded to a multiple of the group size W, and rank r
holds rows [r * V_pad / W, (r + 1) * V_pad / W). Padding rows are zero and never looked up; their logits are cut
off after the gather. With one rank there is no padding, masking or communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.distributed.communication import tp_all_gather, tp_all_reduce
from tritonllm.distributed.parallel_state import get_tp_group
from tritonllm.models.layers.linear import linear
from tritonllm.models.layers.weights import default_weight_loader


@dataclass(slots=True)
class VocabShard:
    """Rows [start, start + rows) of the padded vocabulary on this rank; the real ones end at min(end, vocab)."""

    vocab_size: int
    rank: int
    world_size: int
    rows: int

    @classmethod
    def current(cls, vocab_size: int) -> VocabShard:
        tp = get_tp_group()
        return cls(vocab_size, tp.rank, tp.world_size, -(-vocab_size // tp.world_size))

    @property
    def start(self) -> int:
        return self.rank * self.rows

    @property
    def num_real(self) -> int:
        """Rows of this rank that are real tokens (the rest are padding)."""
        return max(0, min(self.rows, self.vocab_size - self.start))

    @property
    def padded_vocab_size(self) -> int:
        return self.rows * self.world_size


def _vocab_weight(shard: VocabShard, embedding_dim: int, params_dtype: torch.dtype | None) -> nn.Parameter:
    """A [rows, embedding_dim] parameter loading the rank's rows of a [vocab, embedding_dim] checkpoint tensor."""
    weight = nn.Parameter(torch.empty(shard.rows, embedding_dim, dtype=params_dtype), requires_grad=False)
    if shard.world_size == 1:
        weight.weight_loader = default_weight_loader
        return weight

    def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_index: int | None = None) -> None:
        if shard_index is not None:
            raise ValueError(f"this parameter is not fused from shards, got shard index {shard_index}")
        expected = [shard.vocab_size, embedding_dim]
        if list(loaded_weight.shape) != expected:
            raise ValueError(f"expected shape {expected}, found {list(loaded_weight.shape)}")
        with torch.no_grad():
            param.data[: shard.num_real].copy_(loaded_weight[shard.start : shard.start + shard.num_real])
            param.data[shard.num_real :].zero_()

    weight.weight_loader = weight_loader
    weight.tp_sharded = True
    return weight


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] int -> [T, embedding_dim]; weight [rows, embedding_dim], this rank's rows of the vocabulary.

    With W ranks each looks up the ids in its range (others read row 0 and are zeroed) and one all-reduce sums
    the W partial results, of which exactly one is non-zero per token."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard = VocabShard.current(num_embeddings)
        self.weight = _vocab_weight(self.shard, embedding_dim, params_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        mine = (local >= 0) & (local < self.shard.rows)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return tp_all_reduce(out)

    def zero_padding(self) -> None:
        """Zero the padding rows (after something other than the loader filled the weight)."""
        with torch.no_grad():
            self.weight.data[self.shard.num_real :].zero_()

    def extra_repr(self) -> str:
        tp = f", rows={self.shard.start}..{self.shard.start + self.shard.rows}" if self.shard.world_size > 1 else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{tp}"


class ParallelLMHead(nn.Module):
    """hidden [N, H] -> logits [N, vocab] in float32.

    Each rank computes the logits of its vocabulary rows; one all-gather along the vocabulary joins them and the
    padding columns are cut off. With `tied_to`, the head reuses that embedding's (sharded) weight Parameter
    (Llama 3.2 style); the checkpoint's `lm_head.weight`, if it has one, is then redundant and the loader skips it.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tied_to: VocabParallelEmbedding | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tied = tied_to is not None
        self.shard = VocabShard.current(num_embeddings)
        if tied_to is not None:
            if (tied_to.num_embeddings, tied_to.embedding_dim) != (num_embeddings, embedding_dim):
                raise ValueError(
                    f"cannot tie a [{num_embeddings}, {embedding_dim}] head to a "
                    f"[{tied_to.num_embeddings}, {tied_to.embedding_dim}] embedding"
                )
            self.weight = tied_to.weight
        else:
            self.weight = _vocab_weight(self.shard, embedding_dim, params_dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.shard.world_size == 1:
            return logits.float()
        logits = tp_all_gather(logits, dim=-1)  # [N, padded vocab], rank 0's rows first
        if self.shard.padded_vocab_size != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits.float().contiguous()

    def zero_padding(self) -> None:
        with torch.no_grad():
            self.weight.data[self.shard.num_real :].zero_()


# The names the layers had before tensor parallelism.
VocabEmbedding = VocabParallelEmbedding
LMHead = ParallelLMHead
