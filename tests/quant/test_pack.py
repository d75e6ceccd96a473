"""The pure-torch packer: the formats' bit layouts against hand-packed words derived here from the documented
orders, round trips, and quantization error within one step."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import seeds
from tritonllm.quant.pack import (
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_awq_int,
    pack_bits,
    pack_gptq,
    repack_awq_as_gptq,
    unpack_awq,
    unpack_awq_int,
    unpack_bits,
    unpack_gptq,
)


def as_unsigned(word: int) -> int:
    return word & 0xFFFFFFFF


def test_awq_nibble_order_hand_packed():
    # AutoAWQ packs columns 8c .. 8c+7 into one word, nibble i (bits 4i..4i+3) holding column 8c + [0,2,4,6,1,3,5,7][i].
    columns = [1, 2, 3, 4, 5, 6, 7, 8]
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    expected = sum(columns[order[i]] << (4 * i) for i in range(8))
    assert expected == 0x86427531  # nibbles high to low: columns 7 5 3 1 6 4 2 0 hold 8 6 4 2 7 5 3 1
    word = pack_awq_int(torch.tensor([columns]))
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert as_unsigned(int(word)) == expected
    assert unpack_awq_int(word).tolist() == [columns]


def test_gptq_sequential_order_hand_packed():
    # 4-bit GPTQ packs K: word r of a column holds rows 8r .. 8r+7 at nibbles 0..7 in order.
    rows = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [8]])
    word = pack_bits(rows, 4, dim=0)
    assert word.shape == (1, 1) and as_unsigned(int(word)) == 0x87654321
    # 8-bit: four bytes, low byte first.
    word8 = pack_bits(torch.tensor([[0x11, 0x22, 0x33, 0xF4]]), 8, dim=1)
    assert as_unsigned(int(word8)) == 0xF4332211


def test_gptq_3bit_values_cross_word_boundaries():
    # 32 three-bit values fill 3 words; value 10 takes bits 30, 31 of word 0 and bit 0 of word 1, value 21 takes
    # bit 31 of word 1 and bits 0, 1 of word 2 (AutoGPTQ's layout).
    values = torch.zeros(32, 1, dtype=torch.int64)
    values[10] = 0b101
    values[21] = 0b011
    values[0] = 0b111
    words = [as_unsigned(int(w)) for w in pack_bits(values, 3, dim=0)[:, 0]]
    assert words[0] == (0b111 | (0b01 << 30))
    assert words[1] == (0b1 | (0b1 << 31))
    assert words[2] == 0b01
    assert unpack_bits(pack_bits(values, 3, dim=0), 3, dim=0)[:, 0].tolist() == values[:, 0].tolist()


def test_awq_repack_hand_packed():
    # AWQ row k holds columns 0..7 = k + 1 .. k + 8 in one interleaved word. After the repack, GPTQ's word (0, j)
    # holds rows 0..7 of column j at nibbles 0..7: value k + j + 1 at bits 4k.
    rows = [[k + j + 1 for j in range(8)] for k in range(8)]
    awq_words = [sum(row[[0, 2, 4, 6, 1, 3, 5, 7][i]] << (4 * i) for i in range(8)) for row in rows]
    assert awq_words[0] == 0x86427531
    qweight = torch.tensor([[w - 2**32 if w >= 2**31 else w] for w in awq_words], dtype=torch.int32)
    qzeros = torch.tensor([[0x86427531 - 2**32]], dtype=torch.int32)  # columns 0..7 hold zeros 1..8
    gq, gz = repack_awq_as_gptq(qweight, qzeros)
    assert gq.shape == (1, 8) and gz.shape == (1, 1) and gq.dtype == gz.dtype == torch.int32
    assert [as_unsigned(int(w)) for w in gq[0]] == [sum((k + j + 1) << (4 * k) for k in range(8)) for j in range(8)]
    assert as_unsigned(int(gz)) == 0x87654321  # column j's zero j + 1 at nibble j


@given(
    seed=seeds(),
    k_words=st.sampled_from([1, 5, 17]),
    n_words=st.sampled_from([1, 5, 17]),
    chunk_bytes=st.sampled_from([1, 4096, 2**28]),
)
def test_awq_repack_round_trip(seed, k_words, n_words, chunk_bytes):
    # The same 4-bit values and zeros, read through GPTQ's unpacking; any chunking of the columns.
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 16, (8 * k_words, 8 * n_words), generator=g)
    zeros = torch.randint(0, 16, (3, 8 * n_words), generator=g)
    qweight, qzeros = repack_awq_as_gptq(pack_awq_int(ints), pack_awq_int(zeros), chunk_bytes=chunk_bytes)
    assert qweight.shape == (k_words, 8 * n_words) and qzeros.shape == (3, n_words)
    got_ints, got_zeros = unpack_gptq(qweight, qzeros, 4, "gptq_v2")  # v2: zeros read as stored, as AWQ's
    assert torch.equal(got_ints, ints.to(torch.int32)) and torch.equal(got_zeros, zeros.to(torch.int32))


@given(seed=seeds(), bits=st.sampled_from([2, 3, 4, 8]), runs=st.sampled_from([1, 3, 5]), dim=st.sampled_from([0, 1]))
def test_pack_bits_round_trip(seed, bits, runs, dim):
    g = torch.Generator().manual_seed(seed)
    length = runs * (32 if bits == 3 else 32 // bits)
    shape = (length, 3) if dim == 0 else (3, length)
    values = torch.randint(0, 2**bits, shape, generator=g)
    packed = pack_bits(values, bits, dim=dim)
    assert packed.dtype == torch.int32 and packed.shape[dim] == length * bits // 32
    assert torch.equal(unpack_bits(packed, bits, dim=dim), values.to(torch.int32))


def test_gptq_v1_stores_zero_minus_one():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    v1 = pack_gptq(w, bits=4, group_size=32, sym=True, checkpoint_format="gptq")
    v2 = pack_gptq(w, bits=4, group_size=32, sym=True, checkpoint_format="gptq_v2")
    assert (unpack_bits(v2.qzeros, 4, dim=1) == 8).all()  # symmetric 4-bit zero is 8
    assert (unpack_bits(v1.qzeros, 4, dim=1) == 7).all()  # stored as 8 - 1
    assert torch.equal(v1.qweight, v2.qweight)
    assert (unpack_gptq(v1.qweight, v1.qzeros, 4, "gptq")[1] == 8).all()
    # A stored all-ones v1 field reads back as 2**bits, the way v1 readers interpret it.
    ones = torch.full((1, 1), -1, dtype=torch.int32)
    assert (unpack_gptq(v1.qweight[:, :8], ones, 4, "gptq")[1] == 16).all()


def _step_error(w, dequant_t, scales, group):
    """|w - dequant| in units of each weight's quantization step."""
    return (w - dequant_t.t()).abs() / scales.float()[group].t()


@given(
    seed=seeds(),
    n_words=st.sampled_from([1, 5, 17]),
    group_size=st.sampled_from([32, 64, 128, -1]),
    k_groups=st.sampled_from([1, 3]),
)
def test_awq_pack_dequantizes_within_one_step(seed, n_words, group_size, k_groups):
    n, k = 8 * n_words, (group_size if group_size > 0 else 40) * k_groups
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    t = pack_awq(w, group_size)
    g = k if group_size == -1 else group_size
    assert t.qweight.shape == (k, n // 8) and t.qzeros.shape == (k // g, n // 8) and t.scales.shape == (k // g, n)
    assert t.scales.dtype == torch.float16
    deq = dequantize_awq(t.qweight, t.qzeros, t.scales, group_size)
    err = _step_error(w, deq, t.scales, torch.arange(k) // g)
    assert err.max() <= 0.5 + 0.02  # round to nearest; the fp16 rounding of the scale adds a little
    ints, zeros = unpack_awq(t.qweight, t.qzeros)
    assert ints.min() >= 0 and ints.max() <= 15 and zeros.min() >= 0 and zeros.max() <= 15


@given(
    seed=seeds(),
    bits=st.sampled_from([2, 3, 4, 8]),
    group_size=st.sampled_from([32, 64, -1]),
    k=st.sampled_from([32, 96, 160]),
    n_runs=st.sampled_from([1, 3]),
    sym=st.booleans(),
    act_order=st.booleans(),
    checkpoint_format=st.sampled_from(["gptq", "gptq_v2"]),
)
def test_gptq_pack_dequantizes_within_one_step(seed, bits, group_size, k, n_runs, sym, act_order, checkpoint_format):
    n = 32 * n_runs
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    t = pack_gptq(w, bits, group_size, sym, checkpoint_format, act_order=act_order, generator=gen)
    g = k if group_size == -1 else group_size
    groups = -(-k // g)
    assert t.qweight.shape == (k * bits // 32, n) and t.qzeros.shape == (groups, n * bits // 32)
    assert t.scales.shape == (groups, n) and t.g_idx.shape == (k,) and t.g_idx.dtype == torch.int32
    # Every group holds g input features (the last may hold fewer), whatever the order.
    counts = torch.bincount(t.g_idx.long(), minlength=groups)
    assert counts[:-1].eq(g).all() and 0 < counts[-1] <= g
    if not act_order:
        assert torch.equal(t.g_idx.long(), torch.arange(k) // g)
    deq = dequantize_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, bits, checkpoint_format)
    err = _step_error(w, deq, t.scales, t.g_idx.long())
    # Half a step from rounding; fp16 scales shift the 8-bit grid's far end by up to 255 * 2**-11 of a step.
    assert err.max() <= 0.5 + (0.15 if bits == 8 else 0.02)


def test_gptq_given_g_idx_sets_the_groups():
    k, g = 64, 32
    g_idx = torch.arange(k) % 2  # interleaved groups: even features in group 0, odd in group 1
    w = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    t = pack_gptq(w, 4, g, sym=False, checkpoint_format="gptq_v2", g_idx=g_idx)
    assert torch.equal(t.g_idx.long(), g_idx)
    deq = dequantize_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, 4, "gptq_v2")
    assert _step_error(w, deq, t.scales, g_idx).max() <= 0.52


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pack_bits(torch.zeros(1, 5), 4, dim=1), "multiple of 8"),
        (lambda: pack_bits(torch.full((1, 8), 16), 4, dim=1), r"\[0, 16\)"),
        (lambda: pack_awq(torch.randn(12, 32), 32), "multiple of 8"),
        (lambda: pack_awq(torch.randn(8, 48), 32), "multiple of group_size"),
        (lambda: pack_gptq(torch.randn(8, 32), bits=5), "supported"),
        (lambda: pack_gptq(torch.randn(8, 32), checkpoint_format="marlin"), "supported"),
    ],
)
def test_packer_rejects_what_the_format_cannot_hold(call, message):
    with pytest.raises(ValueError, match=message):
        call()
