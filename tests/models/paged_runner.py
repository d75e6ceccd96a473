"""A minimal stand-in for the model runner: real paged KV caches, scattered block tables, flat mixed batches."""

from __future__ import annotations

import torch

from tritonllm.runtime.forward_context import AttentionMetadata, set_forward_context


class PagedRunner:
    """Binds fresh k/v caches [num_blocks, block_size, Hk, D] to a model's Attention layers and steps sequences.

    Physical blocks are handed out in a random order, so block tables are non-contiguous and differ between
    runners with different seeds. Caches start as random values, not zeros, so a read of an unwritten slot shows.
    """

    def __init__(self, model, num_blocks: int = 40, block_size: int = 4, seed: int = 0):
        self.model = model
        self.block_size = block_size
        g = torch.Generator().manual_seed(seed)
        layers = model.attention_layers()
        param = next(model.parameters())
        for layer in layers:
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            layer.k_cache = torch.randn(shape, generator=g).to(param.dtype).to(param.device)
            layer.v_cache = torch.randn(shape, generator=g).to(param.dtype).to(param.device)
        self.device = param.device
        self.free_blocks = torch.randperm(num_blocks, generator=g).tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}

    def _slot(self, seq_id: int, pos: int) -> int:
        table = self.block_tables[seq_id]
        while len(table) <= pos // self.block_size:
            table.append(self.free_blocks.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, batch: list[tuple[int, list[int]]], num_pad: int = 0) -> list[torch.Tensor]:
        """Run one flat step: each (seq_id, new token ids) appends to its sequence. Returns fp32 logits
        [len(new), vocab] per entry. `num_pad` extra tokens with slot -1 trail the batch (as a padded graph would)."""
        input_ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
        for seq_id, tokens in batch:
            self.block_tables.setdefault(seq_id, [])
            start = self.num_tokens.get(seq_id, 0)
            for i, tok in enumerate(tokens):
                input_ids.append(tok)
                positions.append(start + i)
                slots.append(self._slot(seq_id, start + i))
            self.num_tokens[seq_id] = start + len(tokens)
            query_start.append(query_start[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
        input_ids += [0] * num_pad
        positions += [0] * num_pad
        slots += [-1] * num_pad
        max_blocks = max(len(self.block_tables[s]) for s, _ in batch)
        tables = [self.block_tables[s] + [0] * (max_blocks - len(self.block_tables[s])) for s, _ in batch]

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device=self.device)

        meta = AttentionMetadata(
            query_start_loc=i32(query_start),
            seq_lens=i32(seq_lens),
            max_query_len=max(len(t) for _, t in batch),
            max_seq_len=max(seq_lens),
            block_tables=i32(tables),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with torch.no_grad(), set_forward_context(meta):
            hidden = self.model(ids, pos)
            logits = self.model.compute_logits(hidden[: query_start[-1]])
        logits = logits.cpu()  # callers compare with CPU references
        return [logits[query_start[i] : query_start[i + 1]] for i in range(len(batch))]
