"""Token embedding and the output projection to vocabulary logits (optionally sharing the embedding matrix)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.models.layers.weights import default_weight_loader


class VocabEmbedding(nn.Module):
    """input_ids [T] int -> [T, embedding_dim]; weight [num_embeddings, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, vocab] in float32.

    With `tied_to`, the head reuses that embedding's weight Parameter (Llama 3.2 style); the checkpoint's
    `lm_head.weight`, if it has one, is then redundant and the loader skips it.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tied_to: VocabEmbedding | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tied = tied_to is not None
        if tied_to is not None:
            if (tied_to.num_embeddings, tied_to.embedding_dim) != (num_embeddings, embedding_dim):
                raise ValueError(
                    f"cannot tie a [{num_embeddings}, {embedding_dim}] head to a "
                    f"[{tied_to.num_embeddings}, {tied_to.embedding_dim}] embedding"
                )
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(num_embeddings, embedding_dim, dtype=params_dtype), requires_grad=False
            )
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
