"""Tensor-parallel layers on 2 CPU ranks against the same layer unsharded (this process is rank 0 of 1).

Every case loads full checkpoint tensors (one per logical output, as the model loader hands them) through the
layer's weight loaders, so the rank's slicing of dense, AWQ and GPTQ tensors is what is tested. Column layers
must give the reference's columns of the rank's share (q heads, replicated KV heads), row layers the whole output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.distributed.marks import cpu_kernels
from tests.distributed.tp_workers import RankError, TPWorkers
from tests.helpers import assert_close, dtypes, seeds
from tests.quant.checkpoints import awq_settings, gptq_settings
from tritonllm.distributed.parallel_state import get_tp_group, get_tp_rank
from tritonllm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tritonllm.models.layers.parallel_linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tritonllm.quant.config import get_quant_config
from tritonllm.quant.pack import pack_awq, pack_gptq

W = 2


@pytest.fixture(scope="module")
def workers():
    with TPWorkers(world_size=W) as pool:
        yield pool


@dataclass(frozen=True)
class LayerCase:
    kind: str  # "column" | "qkv" | "row"
    input_size: int
    output_sizes: tuple[int, ...] = ()  # column: the fused outputs; row: (N,)
    heads: tuple[int, int, int] = (0, 0, 0)  # qkv: head_size, num_heads, num_kv_heads
    quant: dict[str, Any] | None = field(default=None, hash=False)
    bias: bool = True

    @property
    def logical_outputs(self) -> list[int]:
        if self.kind == "qkv":
            d, h, hk = self.heads
            return [h * d, hk * d, hk * d]
        return list(self.output_sizes)

    @property
    def prefix(self) -> str:
        return {"column": "model.layers.0.mlp.gate_up_proj", "qkv": "model.layers.0.self_attn.qkv_proj"}.get(
            self.kind, "model.layers.0.mlp.down_proj"
        )


def _gptq(bits: int, g: int, desc_act: bool, fmt: str = "gptq", sym: bool = False) -> dict[str, Any]:
    return gptq_settings(bits, g, sym=sym, desc_act=desc_act, checkpoint_format=fmt)


CASES = {
    "column-dense-fused": LayerCase("column", 37, (22, 30)),
    "qkv-dense-split-kv": LayerCase("qkv", 24, heads=(8, 4, 2)),
    "qkv-dense-replicated-kv": LayerCase("qkv", 24, heads=(8, 4, 1)),
    "row-dense": LayerCase("row", 38, (23,)),
    "column-awq-fused": LayerCase("column", 64, (32, 48), quant=awq_settings(32)),
    "row-awq": LayerCase("row", 128, (24,), quant=awq_settings(32)),
    "row-awq-one-group": LayerCase("row", 64, (16,), quant=awq_settings(-1), bias=False),
    "qkv-gptq4-actorder": LayerCase("qkv", 64, heads=(16, 4, 2), quant=_gptq(4, 32, True)),
    "column-gptq3-actorder-fused": LayerCase("column", 64, (64, 64), quant=_gptq(3, 32, True, "gptq_v2")),
    "row-gptq4": LayerCase("row", 128, (24,), quant=_gptq(4, 32, False)),
    "row-gptq4-actorder": LayerCase("row", 128, (24,), quant=_gptq(4, 32, True)),
    "row-gptq3-actorder-v2": LayerCase("row", 128, (32,), quant=_gptq(3, 32, True, "gptq_v2", sym=True)),
    "row-gptq8-one-group": LayerCase("row", 64, (16,), quant=_gptq(8, -1, False)),
}
# The GPTQ path each row-parallel rank must take: act-order keeps every group's scales and dequantizes.
ROW_MODES = {"row-gptq4": "fused", "row-gptq4-actorder": "dequant", "row-gptq8-one-group": "fused"}


def _checkpoint(case: LayerCase, seed: int) -> list[dict[str, torch.Tensor]]:
    """Full checkpoint tensors of each logical output (q/k/v or gate/up), quantized on its own as the tools do."""
    g = torch.Generator().manual_seed(seed)
    k = case.input_size
    shards = []
    for i, n in enumerate(case.logical_outputs):
        weight = torch.randn(n, k, generator=g) / k**0.5
        q = case.quant
        if q is None:
            tensors = {"weight": weight}
        elif q["quant_method"] == "awq":
            t = pack_awq(weight, q["group_size"])
            tensors = {"qweight": t.qweight, "qzeros": t.qzeros, "scales": t.scales}
        else:
            gen = torch.Generator().manual_seed(seed + i)
            t = pack_gptq(
                weight, q["bits"], q["group_size"], q["sym"], q["checkpoint_format"], q["desc_act"], None, gen
            )
            tensors = {"qweight": t.qweight, "qzeros": t.qzeros, "scales": t.scales, "g_idx": t.g_idx}
        if case.bias:
            tensors["bias"] = torch.randn(n, generator=g) * 0.1
        shards.append(tensors)
    return shards


def run_layer(case: LayerCase, dtype: torch.dtype, seed: int, num_tokens: int) -> tuple[torch.Tensor, str | None]:
    """Build the case's layer for this process's tp group, load the full checkpoint, run it on x [T, K].

    A row-parallel rank gets its slice of x's features, as a column-parallel layer before it would hand it over."""
    quant_config = None if case.quant is None else get_quant_config({"quantization_config": case.quant}, None)
    kw = dict(bias=case.bias, quant_config=quant_config, prefix=case.prefix, params_dtype=dtype)
    if case.kind == "column":
        layer = ColumnParallelLinear(case.input_size, list(case.output_sizes), **kw)
    elif case.kind == "qkv":
        d, h, hk = case.heads
        layer = QKVParallelLinear(case.input_size, d, h, hk, **kw)
    else:
        layer = RowParallelLinear(case.input_size, case.output_sizes[0], **kw)
    params = dict(layer.named_parameters())
    for i, tensors in enumerate(_checkpoint(case, seed)):
        for name, t in tensors.items():
            params[name].weight_loader(params[name], t, i if len(case.logical_outputs) > 1 else None)
    layer.linear_method.process_weights_after_loading(layer)

    x = torch.randn(num_tokens, case.input_size, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    tp = get_tp_group()
    if case.kind == "row":
        x = x.chunk(tp.world_size, dim=-1)[tp.rank]
    with torch.no_grad():
        return layer(x), getattr(layer, "gptq_mode", None)


def _rank_columns(case: LayerCase, full: torch.Tensor, rank: int) -> torch.Tensor:
    """The reference's columns that rank `rank` of W must produce."""
    if case.kind == "row":
        return full
    sizes = case.logical_outputs
    pieces = full.split(sizes, dim=-1)
    if case.kind == "column":
        return torch.cat([p.chunk(W, dim=-1)[rank] for p in pieces], dim=-1)
    d, h, hk = case.heads
    q, k, v = pieces
    kv_rank = rank if hk >= W else rank // (W // hk)  # KV head replicated over W / hk ranks
    kv_heads = max(1, hk // W)
    kv = slice(kv_rank * kv_heads * d, (kv_rank + 1) * kv_heads * d)
    return torch.cat([q.chunk(W, dim=-1)[rank], k[:, kv], v[:, kv]], dim=-1)


# Quantized layers run Triton kernels; dense ones only torch matmuls.
@pytest.mark.parametrize("name", [pytest.param(n, marks=cpu_kernels if c.quant else ()) for n, c in CASES.items()])
@settings(max_examples=2, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(seed=seeds(), dtype=dtypes, num_tokens=st.sampled_from([1, 5, 7]))
def test_parallel_linear_matches_unsharded(workers, name, seed, dtype, num_tokens):
    case = CASES[name]
    reference, _ = run_layer(case, dtype, seed, num_tokens)
    for rank, (out, mode) in enumerate(workers.run(run_layer, case, dtype, seed, num_tokens)):
        expected = _rank_columns(case, reference, rank)
        assert out.dtype == dtype and out.shape == expected.shape, (rank, out.shape, expected.shape)
        # Row-parallel partial sums are rounded to the activation dtype before they are added.
        assert_close(out, expected, dtype, scale=4.0)
        if name in ROW_MODES:
            assert mode == ROW_MODES[name], (rank, mode)


def run_vocab(vocab: int, hidden: int, seed: int, tied: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Embedding and head of a [vocab, hidden] table: (embedded ids, logits, the rank's weight rows, pad rows)."""
    g = torch.Generator().manual_seed(seed)
    table, head_table = torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    embed = VocabParallelEmbedding(vocab, hidden)
    embed.weight.weight_loader(embed.weight, table)
    head = ParallelLMHead(vocab, hidden, tied_to=embed if tied else None)
    if not tied:
        head.weight.weight_loader(head.weight, head_table)
    ids = torch.cat(
        [torch.tensor([0, vocab - 1, vocab // 2, (vocab + 1) // 2]), torch.randint(0, vocab, (7,), generator=g)]
    )
    hidden_states = torch.randn(5, hidden, generator=g)
    with torch.no_grad():
        return embed(ids), head(hidden_states), embed.weight.detach().clone(), embed.shard.rows - embed.shard.num_real


@pytest.mark.parametrize("vocab", [37, 40])
@settings(max_examples=2)
@given(seed=seeds(), tied=st.booleans())
def test_vocab_parallel_embedding_and_head(workers, vocab, seed, tied):
    embedded, logits, weight, pad = run_vocab(vocab, 12, seed, tied)
    assert weight.shape == (vocab, 12) and pad == 0  # one rank: no padding
    results = workers.run(run_vocab, vocab, 12, seed, tied)
    for rank, (emb_r, logits_r, weight_r, pad_r) in enumerate(results):
        rows = -(-vocab // W)
        assert weight_r.shape == (rows, 12)
        assert pad_r == (rows * W - vocab if rank == W - 1 else 0)
        assert torch.equal(weight_r[: rows - pad_r], weight[rank * rows : rank * rows + rows - pad_r])
        assert not weight_r[rows - pad_r :].any(), "padding rows must be zero"
        torch.testing.assert_close(emb_r, embedded, atol=0, rtol=0)  # exactly one rank contributes each row
        assert logits_r.dtype == torch.float32 and logits_r.shape == (5, vocab) and logits_r.is_contiguous()
        torch.testing.assert_close(logits_r, logits, atol=1e-5, rtol=1e-5)


def fail_on_last_rank(seconds: float = 0.0) -> int:
    tp = get_tp_group()
    time.sleep(seconds)
    if tp.rank == tp.world_size - 1:
        raise ZeroDivisionError("raised on purpose")
    return tp.rank


# Last in the file: the hang stops the pool (a later run would start a fresh one).
def test_a_rank_exception_reaches_the_parent_with_its_traceback(workers):
    with pytest.raises(RankError, match=r"(?s)fail_on_last_rank failed on rank 1 of 2.*ZeroDivisionError: raised on"):
        workers.run(fail_on_last_rank)
    assert workers.run(get_tp_rank) == [0, 1]  # every rank reported, so the pool carries on


def test_a_hang_fails_after_the_timeout(workers):
    assert workers.run(get_tp_rank) == [0, 1]
    workers.timeout = 1.0
    with pytest.raises(TimeoutError, match="fail_on_last_rank did not finish on every rank within 1 s"):
        workers.run(fail_on_last_rank, 30.0)
