import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, assert_close, dtypes, hidden_sizes, num_tokens, randn, seeds
from tritonllm.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tritonllm.platform import INTERPRET

eps_values = st.sampled_from([1e-6, 1e-5])
input_scales = st.sampled_from([0.01, 1.0, 30.0])
leading_shapes = st.sampled_from([(), (1,), (2, 3)])


def _fused_out_scale(dtype: torch.dtype) -> float:
    # The fused kernel rounds where the reference does (the residual sum, the normalised value, the output), so on
    # a GPU they agree to the usual tolerance. Triton's interpreter truncates fp32 -> bf16 where both round to
    # nearest, adding up to an ulp at each of the three points: about three bf16 ulps, 2.3% at worst.
    return 1.5 if INTERPRET and dtype == torch.bfloat16 else 1.0


def _weight(hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return 1.0 + randn(hidden, dtype=torch.float32, seed=seed + 1, scale=0.5).to(dtype)


@given(tokens=num_tokens, hidden=hidden_sizes, dtype=dtypes, eps=eps_values, scale=input_scales, seed=seeds())
def test_rms_norm_matches_ref(tokens, hidden, dtype, eps, scale, seed):
    x = randn(tokens, hidden, dtype=dtype, seed=seed, scale=scale)
    weight = _weight(hidden, dtype, seed)
    x_before = x.clone()
    out = rms_norm(x, weight, eps)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, rms_norm_ref(x, weight, eps))
    assert torch.equal(x, x_before)


@given(lead=leading_shapes, hidden=hidden_sizes, dtype=dtypes, seed=seeds())
def test_rms_norm_any_leading_shape(lead, hidden, dtype, seed):
    x = randn(*lead, hidden, dtype=dtype, seed=seed)
    weight = _weight(hidden, dtype, seed)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape
    assert_close(out, rms_norm_ref(x, weight, 1e-6))


@given(
    tokens=num_tokens,
    heads=st.sampled_from([1, 3, 8]),
    kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 64, 123]),
    dtype=dtypes,
    seed=seeds(),
)
def test_rms_norm_per_head_view_of_fused_qkv(tokens, heads, kv_heads, head_dim, dtype, seed):
    # Qwen3-style q/k norm: [T, heads, head_dim] views whose token stride is the whole qkv width.
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(tokens, width, dtype=dtype, seed=seed)
    qkv_before = qkv.clone()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    weight = _weight(head_dim, dtype, seed)
    for view in (q, k):
        assert_close(rms_norm(view, weight, 1e-6), rms_norm_ref(view.contiguous(), weight, 1e-6))
    assert torch.equal(qkv, qkv_before)


@given(
    tokens=num_tokens,
    hidden=hidden_sizes,
    dtype=dtypes,
    fp32_residual=st.booleans(),
    eps=eps_values,
    seed=seeds(),
)
def test_fused_add_rms_norm_matches_ref(tokens, hidden, dtype, fp32_residual, eps, seed):
    res_dtype = torch.float32 if fp32_residual else dtype
    x = randn(tokens, hidden, dtype=dtype, seed=seed)
    residual = randn(tokens, hidden, dtype=res_dtype, seed=seed + 2, scale=3.0)
    weight = _weight(hidden, dtype, seed)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    out = fused_add_rms_norm(x, residual, weight, eps)
    assert residual.dtype == res_dtype and out.dtype == dtype
    assert_close(residual, expected_residual)
    assert_close(out, expected_out, dtype=dtype, scale=_fused_out_scale(dtype))


@given(tokens=num_tokens, hidden=hidden_sizes, dtype=dtypes, seed=seeds())
def test_fused_add_rms_norm_strided_rows(tokens, hidden, dtype, seed):
    # x is a column slice of a wider output (row stride > H); the residual is updated through its own strides.
    wide = randn(tokens, hidden + 7, dtype=dtype, seed=seed)
    x = wide[:, 3 : 3 + hidden]
    residual = randn(tokens, hidden, dtype=dtype, seed=seed + 2)
    weight = _weight(hidden, dtype, seed)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    out = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_close(residual, expected_residual)
    assert_close(out, expected_out, scale=_fused_out_scale(dtype))


def test_rms_norm_rejects_bad_inputs():
    x = torch.randn(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(15, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(torch.randn(16, 4, device=DEVICE).t(), torch.ones(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rms_norm(x.double(), torch.ones(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(4, 8, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)
