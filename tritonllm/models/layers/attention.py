"""Causal self-attention over the paged KV cache, driven by the step's AttentionMetadata."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.kernels.kv_cache import write_kv_cache
from tritonllm.kernels.paged_attention import paged_attention
from tritonllm.models.layers.rotary import RotaryEmbedding
from tritonllm.runtime.forward_context import get_forward_context


class Attention(nn.Module):
    """out[t, h] = softmax(scale * q[t, h] . K^T) V over the context of token t's sequence (causal, optional window).

    q [T, num_heads, head_size]; k, v [T, num_kv_heads, head_size] (the new tokens).
    The runner binds `k_cache` / `v_cache`, per-layer views [num_blocks, block_size, num_kv_heads, head_size]
    of its one KV tensor; they are plain attributes (not buffers) so they stay out of the state dict.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """Returns [T, num_heads, head_size] in q's dtype.

        With `rotary_emb` (and the tokens' `positions`), q and k arrive unrotated: the rotation runs in the same
        launch as the KV cache write. Without it they arrive rotated.
        """
        meta = get_forward_context().attn_metadata
        if meta is None:
            # A profiling pass with no cache bound: only the output's shape and memory matter.
            return torch.zeros_like(q)
        if self.k_cache.numel() == 0:
            raise RuntimeError(
                "Attention has no KV cache bound; the runner must set each layer's k_cache/v_cache "
                "(model.attention_layers()) before running with attention metadata"
            )
        if rotary_emb is None:
            write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        elif positions is None:
            raise ValueError("Attention with rotary_emb needs the tokens' positions")
        else:
            q = rotary_emb.rotate_and_cache(positions, q, k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            meta.max_seq_len,
            self.scale,
            sliding_window=self.sliding_window,
        )

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}"
        )
