import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, ODD_SIZES, assert_close, dtypes, num_tokens, randn, seeds
from tritonllm.kernels.penalties import apply_penalties, apply_penalties_ref

vocab_sizes = st.sampled_from([8, 64] + ODD_SIZES)


def penalty_inputs(n: int, v: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Prompt mask, output counts and per-row penalties; about a third of the rows have no penalty at all."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.rand(n, v, generator=g) < 0.3
    output_counts = torch.randint(0, 4, (n, v), generator=g, dtype=torch.int32) * (torch.rand(n, v, generator=g) < 0.2)
    repetition = torch.rand(n, generator=g) * 1.5 + 0.5
    presence = torch.rand(n, generator=g) * 4 - 2
    frequency = torch.rand(n, generator=g) * 4 - 2
    off = torch.rand(n, generator=g) < 0.33
    repetition[off], presence[off], frequency[off] = 1.0, 0.0, 0.0
    tensors = (prompt_mask, output_counts.to(torch.int32), repetition, presence, frequency)
    return tuple(t.to(DEVICE) for t in tensors)


@given(seed=seeds(), n=num_tokens, v=vocab_sizes, dtype=dtypes)
def test_apply_penalties_matches_ref(seed, n, v, dtype):
    logits = randn(n, v, dtype=dtype, seed=seed, scale=3.0)
    pens = penalty_inputs(n, v, seed + 1)
    out = apply_penalties(logits, *pens)
    assert out.dtype == torch.float32
    assert_close(out, apply_penalties_ref(logits, *pens), dtype=torch.float32)


def test_wrapper_rejects_bad_inputs():
    logits = torch.randn(3, 11, device=DEVICE)
    pens = penalty_inputs(3, 11, 0)
    with pytest.raises(ValueError, match="output_counts must be"):
        apply_penalties(logits, pens[0], pens[1].long(), *pens[2:])
    with pytest.raises(ValueError, match="prompt_mask must be"):
        apply_penalties(logits, pens[0][:, :5], *pens[1:])
    with pytest.raises(ValueError, match="presence_penalty must be"):
        apply_penalties(logits, *pens[:3], pens[3].double(), pens[4])
    with pytest.raises(ValueError, match="logits must be float16"):
        apply_penalties(logits.long(), *pens)
