"""Tensor-parallel shapes without a second process: building and loading layers needs no collective, so this process
poses as each rank of a larger group in turn. Column-parallel layers run too (they communicate nothing)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tests.helpers import seeds
from tests.models.checkpoints import hf_model, tiny_config
from tritonllm.distributed import parallel_state
from tritonllm.distributed.parallel_state import TensorParallelGroup
from tritonllm.models.layers.embedding import VocabParallelEmbedding
from tritonllm.models.layers.parallel_linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tritonllm.models.layers.weights import default_weight_loader
from tritonllm.models.loader import load_model
from tritonllm.quant.config import get_quant_config
from tritonllm.quant.pack import pack_awq


@contextlib.contextmanager
def as_rank(rank: int, world_size: int):
    """This process plays `rank` of a tensor-parallel group of `world_size` (no process group: build only)."""
    saved = parallel_state._GROUP
    parallel_state._GROUP = TensorParallelGroup(rank, world_size)
    try:
        yield
    finally:
        parallel_state._GROUP = saved


def _quant(settings: dict):
    return get_quant_config({"quantization_config": settings}, None)


AWQ32 = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
GPTQ32 = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
GPTQ3_ACT = {"quant_method": "gptq", "bits": 3, "group_size": 32, "desc_act": True}

REFUSED = [
    # id, layer factory, message
    (
        "kv-heads",
        lambda: QKVParallelLinear(64, 16, 6, 3, prefix="model.layers.0.self_attn.qkv_proj"),
        r"qkv_proj: num_key_value_heads=3 cannot be split over tensor_parallel_size=2; tensor_parallel_size must "
        r"divide it",
    ),
    (
        "q-heads",
        lambda: QKVParallelLinear(64, 16, 5, 1, prefix="model.layers.0.self_attn.qkv_proj"),
        r"num_attention_heads=5 cannot be split over tensor_parallel_size=2",
    ),
    (
        "column-dense",
        lambda: ColumnParallelLinear(64, [96, 97], prefix="model.layers.0.mlp.gate_up_proj"),
        r"gate_up_proj: up_proj's 97 output features cannot be split evenly over tensor_parallel_size=2",
    ),
    (
        "row-dense",
        lambda: RowParallelLinear(97, 64, prefix="model.layers.0.mlp.down_proj"),
        r"down_proj: its 97 input features cannot be split evenly over tensor_parallel_size=2",
    ),
    (
        "awq-columns",
        lambda: ColumnParallelLinear(
            64, [24, 24], quant_config=_quant(AWQ32), prefix="model.layers.0.mlp.gate_up_proj"
        ),
        r"AWQ packs 8 columns per int32 word: the rank's share 12 of gate_proj's 24 columns, the rank's share 12 of "
        r"up_proj's 24 columns are each not a multiple of 8 \(tensor_parallel_size=2\)",
    ),
    (
        "awq-groups",
        lambda: RowParallelLinear(96, 64, quant_config=_quant(AWQ32), prefix="model.layers.0.mlp.down_proj"),
        r"down_proj: AWQ group_size 32: the rank's share 48 of its 96 input features is not a multiple of 32 "
        r"\(tensor_parallel_size=2\); a row-parallel layer needs whole quant groups",
    ),
    (
        "gptq-groups",
        lambda: RowParallelLinear(96, 64, quant_config=_quant(GPTQ32), prefix="model.layers.0.mlp.down_proj"),
        r"GPTQ group_size 32: the rank's share 48 of its 96 input features is not a multiple of 32",
    ),
    (
        "gptq3-packing",
        lambda: RowParallelLinear(96, 64, quant_config=_quant(GPTQ3_ACT), prefix="model.layers.0.mlp.down_proj"),
        r"3-bit GPTQ packs K in runs of 32: the rank's share 48 of its 96 input features is not a multiple of 32",
    ),
]


@pytest.mark.parametrize(("factory", "message"), [pytest.param(*r[1:], id=r[0]) for r in REFUSED])
def test_indivisible_shapes_are_refused_at_build(factory, message):
    with as_rank(1, 2), pytest.raises(ValueError, match=message):
        factory()


def test_model_build_names_the_config_field(tmp_path):
    config = tiny_config("LlamaForCausalLM", num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with as_rank(0, 2), pytest.raises(ValueError, match="num_key_value_heads=3 .* tensor_parallel_size must divide it"):
        load_model(str(tmp_path), load_format="dummy", device="cpu")


def _column_reference(weight: torch.Tensor, sizes: list[int], starts: list[int], shares: list[int]) -> torch.Tensor:
    """Rows of a fused [sum(sizes), K] weight a rank holds: output i's rows [starts[i], starts[i] + shares[i])."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([weight[o + s : o + s + n] for o, s, n in zip(offsets, starts, shares, strict=True)])


@settings(max_examples=4)
@given(seed=seeds(), world_size=st.sampled_from([2, 4, 8]), num_kv_heads=st.sampled_from([1, 2, 4, 8]))
def test_qkv_shares_and_replicated_kv_heads(seed, world_size, num_kv_heads):
    """Rank r holds q heads [r*H/W, (r+1)*H/W) and KV heads [r*Hk/W, ...), or KV head r // (W / Hk) when W > Hk."""
    d, h, hidden = 4, 8, 12
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n * d, hidden, generator=g) for n in (h, num_kv_heads, num_kv_heads))
    bias = [torch.randn(n * d, generator=g) for n in (h, num_kv_heads, num_kv_heads)]
    x = torch.randn(3, hidden, generator=g)
    for rank in range(world_size):
        with as_rank(rank, world_size):
            layer = QKVParallelLinear(hidden, d, h, num_kv_heads, bias=True, prefix="qkv_proj")
        for i, (w, b) in enumerate(zip((q, k, v), bias, strict=True)):
            layer.weight.weight_loader(layer.weight, w, i)
            layer.bias.weight_loader(layer.bias, b, i)
        kv_heads = max(1, num_kv_heads // world_size)
        kv_head0 = rank * num_kv_heads // world_size  # W > Hk: W / Hk consecutive ranks share a KV head
        assert (layer.num_heads, layer.num_kv_heads) == (h // world_size, kv_heads)
        qs = slice(rank * h // world_size * d, (rank + 1) * h // world_size * d)
        ks = slice(kv_head0 * d, (kv_head0 + kv_heads) * d)
        expected_w = torch.cat([q[qs], k[ks], v[ks]])
        assert torch.equal(layer.weight, expected_w)
        # A checkpoint that stores the layer already fused ([q; k; v] under qkv_proj) loads to the same share.
        with as_rank(rank, world_size):
            fused = QKVParallelLinear(hidden, d, h, num_kv_heads, prefix="qkv_proj")
        fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]), None)
        assert torch.equal(fused.weight, expected_w)
        with torch.no_grad():
            torch.testing.assert_close(
                layer(x), x @ expected_w.t() + torch.cat([bias[0][qs], bias[1][ks], bias[2][ks]])
            )


@settings(max_examples=3)
@given(seed=seeds(), world_size=st.sampled_from([2, 4]))
def test_awq_column_shares_load_whole_words(seed, world_size):
    """A fused AWQ layer loaded from whole checkpoint tensors holds each output's rank columns (8 per word)."""
    k, sizes = 64, [64, 32]
    g = torch.Generator().manual_seed(seed)
    packed = [pack_awq(torch.randn(n, k, generator=g), 32) for n in sizes]
    for rank in range(world_size):
        with as_rank(rank, world_size):
            layer = ColumnParallelLinear(k, sizes, quant_config=_quant(AWQ32), prefix="model.layers.0.mlp.gate_up_proj")
        for i, t in enumerate(packed):
            for name in ("qweight", "qzeros", "scales"):
                param = getattr(layer, name)
                param.weight_loader(param, getattr(t, name), i)
        shares = [n // world_size for n in sizes]
        for name, per_column in (("qweight", 8), ("qzeros", 8), ("scales", 1)):
            full = torch.cat([getattr(t, name) for t in packed], dim=1)
            cols = [n // per_column for n in sizes]
            expected = _column_reference(
                full.t(), cols, [rank * s // per_column for s in shares], [s // per_column for s in shares]
            )
            assert torch.equal(getattr(layer, name), expected.t()), name


def test_loader_reports_checkpoint_shapes(tmp_path):
    config = tiny_config("LlamaForCausalLM", tie_word_embeddings=False)
    model = hf_model(config, seed=3)
    tensors = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(97, 64)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    tensors["lm_head.weight"] = torch.zeros(300, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with as_rank(1, 2), pytest.raises(ValueError) as e:
        load_model(str(tmp_path), device="cpu")
    msg = str(e.value)
    assert "mis-shaped (3)" in msg
    assert "model.layers.1.mlp.up_proj.weight (expected shape [96, 64], found [97, 64])" in msg
    assert "model.layers.0.mlp.down_proj.weight (expected shape [64, 96], found [64, 95])" in msg
    assert "lm_head.weight (expected shape [301, 64], found [300, 64])" in msg


def test_dummy_weights_fill_the_rank_shard(tmp_path):
    config = tiny_config("LlamaForCausalLM", tie_word_embeddings=False)  # vocab 301: one padding row at W=2
    (tmp_path / "config.json").write_text(json.dumps(config))
    models = []
    for rank in range(2):
        with as_rank(rank, 2):
            models.append(load_model(str(tmp_path), load_format="dummy", device="cpu")[0])
    params = [dict(m.named_parameters()) for m in models]
    assert params[0]["model.embed_tokens.weight"].shape == (151, 64)
    assert params[0]["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 + 2) * 16 // 2, 64)
    assert params[0]["model.layers.0.mlp.down_proj.weight"].shape == (64, 48)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert not params[1][name][150:].any(), "vocabulary padding rows must stay zero"
    for name, p in params[0].items():
        # Replicated parameters (norms) agree across ranks; each rank draws its own shards.
        assert torch.equal(p, params[1][name]) != getattr(p, "tp_sharded", False), name


def test_one_rank_keeps_the_plain_layers():
    """Without a group the layers are exactly the unsharded ones: no padding, no wrapped loaders."""
    embed = VocabParallelEmbedding(301, 8)
    assert embed.weight.shape == (301, 8) and embed.weight.weight_loader is default_weight_loader
    layer = RowParallelLinear(96, 64, bias=True, prefix="down_proj")
    assert layer.weight.shape == (64, 96) and not hasattr(layer.weight, "tp_sharded")
    assert layer.weight.weight_loader.__qualname__.startswith("make_row_loader")
