import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, assert_close, dtypes, hidden_sizes, num_tokens, randn, seeds
from tritonllm.kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref

ACTIVATIONS = {"silu": (silu_and_mul, silu_and_mul_ref), "gelu_tanh": (gelu_tanh_and_mul, gelu_tanh_and_mul_ref)}
activations = st.sampled_from(sorted(ACTIVATIONS))


@given(
    tokens=num_tokens,
    inter=hidden_sizes,
    dtype=dtypes,
    act=activations,
    scale=st.sampled_from([1.0, 6.0]),
    seed=seeds(),
)
def test_act_and_mul_matches_ref(tokens, inter, dtype, act, scale, seed):
    fn, ref = ACTIVATIONS[act]
    x = randn(tokens, 2 * inter, dtype=dtype, seed=seed, scale=scale)
    x_before = x.clone()
    out = fn(x)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    assert_close(out, ref(x))
    assert torch.equal(x, x_before)


@given(inter=st.sampled_from([5, 1151, 2500]), dtype=dtypes, act=activations, seed=seeds())
def test_act_and_mul_strided_rows_and_leading_dims(inter, dtype, act, seed):
    # gate_up slice of a wider [T, 2I + pad] output, then a [2, 3, 2I] batch: rows addressed by one stride.
    fn, ref = ACTIVATIONS[act]
    wide = randn(3, 2 * inter + 9, dtype=dtype, seed=seed, scale=2.0)
    x = wide[:, 4 : 4 + 2 * inter]
    assert_close(fn(x), ref(x.contiguous()))
    batched = randn(2, 3, 2 * inter, dtype=dtype, seed=seed + 1, scale=2.0)
    out = fn(batched)
    assert out.shape == (2, 3, inter)
    assert_close(out, ref(batched))


def test_act_and_mul_rejects_bad_inputs():
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.randn(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        gelu_tanh_and_mul(torch.randn(8, 3, device=DEVICE).t())
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        silu_and_mul(torch.randn(3, 8, device=DEVICE).double())
