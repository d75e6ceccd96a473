"""AWQ and GPTQ linear methods inside a fused Linear: shards loaded through the weight loaders, processed, and run;
the output equals x @ [dequant(shard 0); dequant(shard 1); ...]^T + bias per activation dtype, for a few rows (the
fused kernels) and for DEQUANT_MIN_M rows and more (dequantize + matmul)."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.helpers import DEVICE, assert_close, dtypes, randn, seeds
from tritonllm.kernels.quant_gemm_config import DEQUANT_MIN_M
from tritonllm.models.layers.linear import Linear
from tritonllm.quant.awq import AwqConfig
from tritonllm.quant.gptq import GptqConfig
from tritonllm.quant.pack import dequantize_awq, dequantize_gptq, pack_awq, pack_gptq, regular_g_idx

TOL_SCALE = 2.0  # the weight is rounded to the activation dtype before the dot (see test_quant_gemm)
row_counts = st.sampled_from([5, DEQUANT_MIN_M + 1])


def _linear(config, k, sizes, dtype, bias):
    with torch.device(DEVICE):
        return Linear(
            k, sizes, bias=bias, quant_config=config, prefix="model.layers.0.self_attn.qkv_proj", params_dtype=dtype
        )


def _load(layer, shards, bias):
    """Load each shard's tensors by name, as the model loader does (shard_index = position in output_sizes)."""
    params = dict(layer.named_parameters())
    for i, tensors in enumerate(shards):
        for name, t in tensors.items():
            params[name].weight_loader(params[name], t.to(DEVICE), i)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias, None)
    layer.linear_method.process_weights_after_loading(layer)


def _check(layer, weight_t, bias, dtype, seed, m=5):
    x = randn(m, weight_t.shape[0], dtype=dtype, seed=seed)
    y = layer(x)
    expected = x.float() @ weight_t.to(DEVICE)
    if bias is not None:
        expected = expected + bias.float()
    assert y.dtype == dtype and y.shape == (m, weight_t.shape[1])
    assert_close(y, expected, dtype, scale=TOL_SCALE)


@given(seed=seeds(), dtype=dtypes, group_size=st.sampled_from([32, -1]), has_bias=st.booleans(), rows=row_counts)
@example(seed=0, dtype=torch.bfloat16, group_size=32, has_bias=True, rows=DEQUANT_MIN_M + 1)
def test_awq_fused_layer(seed, dtype, group_size, has_bias, rows):
    k, sizes = 64, [40, 16, 24]
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, k, generator=g) / k**0.5 for n in sizes]
    packed = [pack_awq(w, group_size) for w in weights]
    layer = _linear(AwqConfig(group_size=group_size), k, sizes, dtype, has_bias)
    bias = randn(sum(sizes), dtype=dtype, seed=seed + 1) if has_bias else None
    _load(layer, [{"qweight": t.qweight, "qzeros": t.qzeros, "scales": t.scales} for t in packed], bias)
    assert layer.qweight.shape == (k // 8, sum(sizes))  # repacked at load into GPTQ's layout
    weight_t = torch.cat([dequantize_awq(t.qweight, t.qzeros, t.scales, group_size) for t in packed], dim=1)
    _check(layer, weight_t, bias, dtype, seed + 2, rows)


@given(
    seed=seeds(),
    dtype=dtypes,
    bits=st.sampled_from([2, 3, 4, 8]),
    group_size=st.sampled_from([32, -1]),
    order=st.sampled_from(["regular", "act_order", "act_order_per_shard", "missing"]),
    sym=st.booleans(),
    checkpoint_format=st.sampled_from(["gptq", "gptq_v2"]),
    rows=row_counts,
)
# The cases that pick each path, whatever the draw: act-order permuted into the fused kernels and folded into the
# dense weight's rows, per-shard orders and 3-bit through dequantization.
@example(
    seed=1, dtype=torch.float16, bits=4, group_size=32, order="act_order", sym=False, checkpoint_format="gptq", rows=5
)
@example(
    seed=2, dtype=torch.bfloat16, bits=8, group_size=32, order="act_order", sym=True, checkpoint_format="gptq_v2",
    rows=DEQUANT_MIN_M + 1,
)  # fmt: skip
@example(
    seed=3, dtype=torch.float32, bits=2, group_size=32, order="act_order_per_shard", sym=False,
    checkpoint_format="gptq", rows=5,
)  # fmt: skip
@example(
    seed=4, dtype=torch.float16, bits=3, group_size=32, order="act_order", sym=True, checkpoint_format="gptq", rows=5
)
def test_gptq_fused_layer(seed, dtype, bits, group_size, order, sym, checkpoint_format, rows):
    k, sizes = 64, [32, 64]
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    shared = regular_g_idx(k, gs)[torch.randperm(k, generator=g)]  # one act-order for all shards
    packed = []
    for n in sizes:
        w = torch.randn(n, k, generator=g) / k**0.5
        if order == "act_order":
            g_idx = shared
        elif order == "act_order_per_shard":
            g_idx = regular_g_idx(k, gs)[torch.randperm(k, generator=g)]
        else:
            g_idx = None
        packed.append(pack_gptq(w, bits, group_size, sym, checkpoint_format, g_idx=g_idx))
    config = GptqConfig(bits=bits, group_size=group_size, sym=sym, checkpoint_format=checkpoint_format)
    layer = _linear(config, k, sizes, dtype, bias=False)
    tensors = [{"qweight": t.qweight, "qzeros": t.qzeros, "scales": t.scales, "g_idx": t.g_idx} for t in packed]
    if order == "missing":  # old checkpoints (and dummy weights) have no g_idx: regular groups
        for t in tensors:
            del t["g_idx"]
    _load(layer, tensors, None)

    per_shard_order = order == "act_order_per_shard" and group_size != -1
    fused = bits != 3 and not per_shard_order
    assert layer.gptq_mode == ("fused" if fused else "dequant")
    if fused and order == "act_order" and group_size != -1:
        assert layer.gptq_perm is not None and torch.equal(
            layer.gptq_perm.cpu().long(), torch.argsort(shared, stable=True)
        )
    weight_t = torch.cat(
        [dequantize_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, bits, checkpoint_format) for t in packed], dim=1
    )
    _check(layer, weight_t, None, dtype, seed + 1, rows)


def test_gptq_irregular_g_idx_runs_through_dequantization():
    # Groups of unequal size (not a permutation of runs of g) still compute exactly via per-call dequantization.
    k, n = 64, 32
    g_idx = torch.cat([torch.zeros(10), torch.ones(54)]).long()
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) / 8
    t = pack_gptq(w, 4, 32, False, "gptq_v2", g_idx=g_idx)
    layer = _linear(GptqConfig(bits=4, group_size=32, checkpoint_format="gptq_v2"), k, [n], torch.float32, False)
    _load(layer, [{"qweight": t.qweight, "qzeros": t.qzeros, "scales": t.scales, "g_idx": t.g_idx}], None)
    assert layer.gptq_mode == "dequant"
    _check(layer, dequantize_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, 4, "gptq_v2"), None, torch.float32, 6)


def test_loaders_reject_wrong_dtype_shape_and_groups():
    layer = _linear(GptqConfig(bits=4, group_size=32), 64, [32, 64], torch.float16, False)
    qweight = layer.qweight
    with pytest.raises(ValueError, match="qweight must be stored as torch.int32"):
        qweight.weight_loader(qweight, torch.zeros(8, 32, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"expected qweight shape \[8, 32\]"):
        qweight.weight_loader(qweight, torch.zeros(8, 64, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="shard index 2 out of range"):
        qweight.weight_loader(qweight, torch.zeros(8, 32, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"g_idx values must lie in \[0, 2\)"):
        layer.g_idx.weight_loader(layer.g_idx, torch.full((64,), 2, dtype=torch.int32), 1)


@pytest.mark.parametrize(
    ("config", "k", "sizes", "message"),
    [
        (AwqConfig(group_size=32), 48, [8], "does not divide the input size 48"),
        (AwqConfig(group_size=32), 64, [8, 12], r"output sizes \[12\]"),
        (GptqConfig(bits=3, group_size=32), 48, [32], "runs of 32"),
        (GptqConfig(bits=4, group_size=32), 64, [12], r"output sizes \[12\]"),
    ],
)
def test_layer_shapes_the_format_cannot_hold_are_refused(config, k, sizes, message):
    with pytest.raises(ValueError, match=message):
        _linear(config, k, sizes, torch.float16, False)
