"""Dequantization kernels: exact against the packer's dequantization and against the kernel file's references, on
random packed words covering every field value (v1 all-ones zeros included) and every GPTQ bit width."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, seeds
from tritonllm.kernels.quant_dequant import awq_dequantize, awq_dequantize_ref, gptq_dequantize, gptq_dequantize_ref
from tritonllm.quant.pack import dequantize_awq, dequantize_gptq, pack_awq_int, pack_bits


def _scales(groups, n, g):
    return (torch.rand(groups, n, generator=g) * 0.1 + 0.01).to(torch.float16)


def test_awq_dequantize_reads_the_documented_nibble_order():
    # Column j of word 0 carries value j + 1; nibble i holds column [0,2,4,6,1,3,5,7][i] (derived in test_pack).
    qweight = torch.tensor([[0x86427531 - 2**32]], dtype=torch.int32, device=DEVICE)
    qzeros = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    scales = torch.ones(1, 8, dtype=torch.float16, device=DEVICE)
    w = awq_dequantize(qweight, qzeros, scales, group_size=-1, dtype=torch.float32)
    assert w.cpu().tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]]
    # Zeros use the same order: zero word 0x86427531 subtracts j + 1 from column j.
    w0 = awq_dequantize(qweight, qweight.clone(), scales, group_size=-1, dtype=torch.float32)
    assert w0.abs().max() == 0


@given(
    seed=seeds(),
    n_words=st.sampled_from([1, 5, 17]),
    group_size=st.sampled_from([32, 64, 128, -1]),
    k_groups=st.sampled_from([1, 3]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
)
def test_awq_dequantize_matches_references(seed, n_words, group_size, k_groups, dtype):
    g = torch.Generator().manual_seed(seed)
    n = 8 * n_words
    k = (group_size if group_size > 0 else 40) * k_groups
    groups = 1 if group_size == -1 else k // group_size
    qweight = pack_awq_int(torch.randint(0, 16, (k, n), generator=g))
    qzeros = pack_awq_int(torch.randint(0, 16, (groups, n), generator=g))
    scales = _scales(groups, n, g)
    expected = dequantize_awq(qweight, qzeros, scales, group_size)
    torch.testing.assert_close(awq_dequantize_ref(qweight, qzeros, scales, group_size), expected, rtol=0, atol=0)
    got = awq_dequantize(qweight.to(DEVICE), qzeros.to(DEVICE), scales.to(DEVICE), group_size, dtype=dtype)
    assert got.dtype == dtype and got.shape == (k, n)
    # Computed in fp32 and rounded once to dtype: the rounded reference, to the last bit except that Triton's
    # interpreter truncates fp32 -> bf16 where a GPU rounds to nearest (one bf16 ulp).
    rtol = 2**-7 if dtype == torch.bfloat16 else 0
    torch.testing.assert_close(got.cpu(), expected.to(dtype), rtol=rtol, atol=0)


@given(
    seed=seeds(),
    bits=st.sampled_from([2, 3, 4, 8]),
    k=st.sampled_from([32, 96, 160]),
    n_runs=st.sampled_from([1, 3]),
    group_size=st.sampled_from([32, 64, -1]),
    act_order=st.booleans(),
    checkpoint_format=st.sampled_from(["gptq", "gptq_v2"]),
)
def test_gptq_dequantize_matches_references(seed, bits, k, n_runs, group_size, act_order, checkpoint_format):
    g = torch.Generator().manual_seed(seed)
    n = 32 * n_runs
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    g_idx = torch.arange(k) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    g_idx = g_idx.to(torch.int32)
    qweight = pack_bits(torch.randint(0, 2**bits, (k, n), generator=g), bits, dim=0)
    qzeros = pack_bits(torch.randint(0, 2**bits, (groups, n), generator=g), bits, dim=1)  # all-ones fields too
    scales = _scales(groups, n, g)
    zero_offset = 1 if checkpoint_format == "gptq" else 0
    expected = dequantize_gptq(qweight, qzeros, scales, g_idx, bits, checkpoint_format)
    ref = gptq_dequantize_ref(qweight, qzeros, scales, g_idx, bits, group_size, zero_offset)
    torch.testing.assert_close(ref, expected, rtol=0, atol=0)
    got = gptq_dequantize(
        qweight.to(DEVICE),
        qzeros.to(DEVICE),
        scales.to(DEVICE),
        g_idx.to(DEVICE),
        bits,
        group_size,
        zero_offset,
        torch.float32,
    )
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
    if not act_order:  # g_idx None means the regular groups
        plain = gptq_dequantize(
            qweight.to(DEVICE), qzeros.to(DEVICE), scales.to(DEVICE), None, bits, group_size, zero_offset, torch.float32
        )
        torch.testing.assert_close(plain.cpu(), expected, rtol=0, atol=0)


def test_dequantize_reads_strided_column_slices():
    # Fused layers dequantize shard by shard through column slices of the packed tensors.
    g = torch.Generator().manual_seed(1)
    k, n, bits = 64, 96, 4
    qweight = pack_bits(torch.randint(0, 16, (k, n), generator=g), bits, dim=0)
    qzeros = pack_bits(torch.randint(0, 16, (2, n), generator=g), bits, dim=1)
    scales = _scales(2, n, g)
    full = dequantize_gptq(qweight, qzeros, scales, torch.arange(k) // 32, bits, "gptq_v2")
    part = gptq_dequantize(
        qweight[:, 32:96].to(DEVICE),
        qzeros[:, 4:12].to(DEVICE),
        scales[:, 32:96].to(DEVICE),
        None,
        bits,
        32,
        0,
        torch.float32,
    )
    torch.testing.assert_close(part.cpu(), full[:, 32:96], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda z: awq_dequantize(z((8, 1)), z((1, 1)), z((1, 8), torch.float16), 3), "group_size"),
        (lambda z: awq_dequantize(z((8, 1)), z((2, 1)), z((1, 8), torch.float16), -1), "shapes disagree"),
        (lambda z: awq_dequantize(z((8, 1), torch.int64), z((1, 1)), z((1, 8), torch.float16), -1), "int32"),
        (lambda z: gptq_dequantize(z((1, 8)), z((1, 1)), z((1, 8), torch.float16), None, 5, -1), "bits"),
        (lambda z: gptq_dequantize(z((1, 8)), z((1, 1)), z((1, 8), torch.float16), z((4,)), 4, -1), "g_idx"),
    ],
)
def test_dequantize_rejects_bad_inputs(call, message):
    def z(shape, dtype=torch.int32):
        return torch.zeros(shape, dtype=dtype, device=DEVICE)

    with pytest.raises(ValueError, match=message):
        call(z)
