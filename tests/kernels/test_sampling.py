import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, dtypes, num_tokens, randn, seeds
from tests.kernels.test_penalties import penalty_inputs, vocab_sizes
from tritonllm.kernels.penalties import apply_penalties_ref
from tritonllm.kernels.sampling import sample, sample_probs_ref


def _row_seeds(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seeds_ = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 1 << 20, (n,), generator=g, dtype=torch.int64)
    return seeds_.to(DEVICE), positions.to(DEVICE)


def _chi2_bound(df: int) -> float:
    """Chi-square quantile at 1 - 1e-6 (Wilson-Hilferty): a correct sampler fails it once in a million."""
    z = 4.753
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; cells expecting fewer than 5 draws are pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


@given(
    seed=seeds(), n=num_tokens, v=vocab_sizes, dtype=dtypes, penalize=st.booleans(), block_v=st.sampled_from([None, 32])
)
def test_greedy_rows_pick_a_maximal_logit(seed, n, v, dtype, penalize, block_v):
    logits = randn(n, v, dtype=dtype, seed=seed, scale=3.0)
    pens = penalty_inputs(n, v, seed + 1) if penalize else None
    seeds_, positions = _row_seeds(n, seed + 2)
    temperature = torch.rand(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE) + 0.5
    greedy = torch.arange(n, device=DEVICE) % 2 == 0
    temperature[greedy] = 0.0
    x = apply_penalties_ref(logits, *pens) if penalize else logits.float()
    best = x.max(dim=1).values

    mixed = sample(logits, temperature, seeds_, positions, *(pens or ()), block_v=block_v)
    all_greedy = sample(logits, None, None, None, *(pens or ()), block_v=block_v)
    # Ties (likely in bf16) may go to any maximal token, so compare logit values, not ids.
    torch.testing.assert_close(x.gather(1, all_greedy[:, None])[:, 0], best, rtol=0, atol=0)
    torch.testing.assert_close(x.gather(1, mixed[:, None])[greedy, 0], best[greedy], rtol=0, atol=0)
    assert torch.equal(mixed[greedy], all_greedy[greedy])


@given(
    seed=seeds(),
    v=st.sampled_from([5, 7, 11, 123]),
    dtype=dtypes,
    temperature=st.sampled_from([0.6, 1.0, 1.7]),
    penalize=st.booleans(),
)
def test_sampled_distribution_matches_probabilities(seed, v, dtype, temperature, penalize):
    draws = 8000
    # Logits spread over [-2, 2] in a random order, so that the power check below always has a margin.
    order = torch.randperm(v, generator=torch.Generator().manual_seed(seed))
    row = torch.linspace(-2, 2, v)[order].to(DEVICE) + randn(v, dtype=torch.float32, seed=seed, scale=0.2)
    row = row.to(dtype)[None, :]
    banned = order[:1]
    row[0, banned[0]] = float("-inf")  # a filtered-out token: must never be drawn
    logits = row.expand(draws, v).contiguous()
    temps = torch.full((draws,), temperature, device=DEVICE)
    if penalize:
        pens = tuple(t[:1].expand(draws, *t.shape[1:]).contiguous() for t in penalty_inputs(1, v, seed + 1))
        # On for every draw, and mild enough to leave the distribution spread (for the power check).
        pens[2].fill_(1.3), pens[3].fill_(0.4), pens[4].fill_(-0.3)
    else:
        pens = None
    seeds_, positions = _row_seeds(draws, seed + 2)
    tokens = sample(logits, temps, seeds_, positions, *(pens or ()))

    counts = torch.bincount(tokens.cpu(), minlength=v)
    probs = sample_probs_ref(logits[:1], temps[:1], tuple(t[:1] for t in pens) if pens else None)[0].cpu()
    assert counts[banned[0]] == 0
    stat, df = _chi2(counts, probs)
    assert stat < _chi2_bound(df), f"chi2 {stat:.1f} with {df} dof; counts {counts.tolist()} probs {probs.tolist()}"
    # The bound has power: the same counts must reject a distribution 30% off in temperature.
    wrong = sample_probs_ref(logits[:1], temps[:1] * 1.3, tuple(t[:1] for t in pens) if pens else None)[0].cpu()
    wrong_stat, wrong_df = _chi2(counts, wrong)
    assert wrong_stat > _chi2_bound(wrong_df), "the test cannot tell this sampler from a wrong one; raise draws"


@given(seed=seeds(), n=st.sampled_from([3, 7, 16]), v=vocab_sizes, dtype=dtypes, penalize=st.booleans())
def test_samples_depend_only_on_seed_position_and_logits(seed, n, v, dtype, penalize):
    logits = randn(n, v, dtype=dtype, seed=seed, scale=0.5)
    pens = penalty_inputs(n, v, seed + 1) if penalize else ()
    seeds_, positions = _row_seeds(n, seed + 2)
    temps = torch.full((n,), 1.0, device=DEVICE)
    temps[0] = 0.0
    tokens = sample(logits, temps, seeds_, positions, *pens)
    assert torch.equal(sample(logits, temps, seeds_, positions, *pens), tokens)
    # Tiling the vocab differently changes nothing.
    assert torch.equal(sample(logits, temps, seeds_, positions, *pens, block_v=32), tokens)

    # The rows inside a bigger, shuffled batch with other requests draw the same tokens.
    others = 5
    perm = torch.randperm(n + others, generator=torch.Generator().manual_seed(seed))
    big_logits = torch.cat([logits, randn(others, v, dtype=dtype, seed=seed + 3)])[perm]
    big_temps = torch.cat([temps, torch.full((others,), 0.8, device=DEVICE)])[perm]
    other_seeds, other_positions = _row_seeds(others, seed + 4)
    big_seeds = torch.cat([seeds_, other_seeds])[perm]
    big_positions = torch.cat([positions, other_positions])[perm]
    big_pens = ()
    if penalize:
        extra = penalty_inputs(others, v, seed + 5)
        big_pens = tuple(torch.cat([a, b])[perm].contiguous() for a, b in zip(pens, extra, strict=True))
    big = sample(big_logits, big_temps, big_seeds, big_positions, *big_pens)
    inverse = torch.argsort(perm)
    assert torch.equal(big[inverse[:n]], tokens)


# Row patterns of non-finite logits (as an fp16 model that overflows produces them).
NON_FINITE_ROWS = ["some_nan", "all_nan", "nan_and_neg_inf", "all_neg_inf", "pos_inf_and_nan", "finite"]


def _non_finite_logits(kinds: list[str], v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(kinds), v, generator=g) * 3.0
    nan, inf = float("nan"), float("inf")
    for r, kind in enumerate(kinds):
        some = torch.rand(v, generator=g) < 0.3
        if kind == "some_nan":
            x[r, some] = nan
        elif kind == "all_nan":
            x[r] = nan
        elif kind == "nan_and_neg_inf":
            x[r] = -inf
            x[r, some] = nan
        elif kind == "all_neg_inf":
            x[r] = -inf
        elif kind == "pos_inf_and_nan":
            x[r, some] = nan
            x[r, torch.randint(0, v, (2,), generator=g)] = inf
    return x.to(dtype=dtype, device=DEVICE)


@given(
    seed=seeds(),
    kinds=st.lists(st.sampled_from(NON_FINITE_ROWS), min_size=1, max_size=8),
    v=st.sampled_from([5, 123, 1151]),
    dtype=dtypes,
    penalize=st.booleans(),
    block_v=st.sampled_from([None, 16, 128]),
)
def test_non_finite_logits_give_tokens_in_range(seed, kinds, v, dtype, penalize, block_v):
    # NaN counts as -inf; +inf tokens win (the lowest first); a row with nothing above -inf gives token 0. Small
    # block_v splits the vocab into tiles (the last one padded), None keeps one tile per row.
    n = len(kinds)
    logits = _non_finite_logits(kinds, v, dtype, seed)
    pens = penalty_inputs(n, v, seed + 1) if penalize else None
    seeds_, positions = _row_seeds(n, seed + 2)
    temperature = torch.rand(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE) + 0.5
    greedy = torch.arange(n, device=DEVICE) % 2 == 0
    temperature[greedy] = 0.0
    x = apply_penalties_ref(logits, *pens) if penalize else logits.float()
    x = torch.where(x.isnan(), float("-inf"), x)
    best = x.max(dim=1).values
    probs = sample_probs_ref(logits, temperature, pens)

    mixed = sample(logits, temperature, seeds_, positions, *(pens or ()), block_v=block_v)
    all_greedy = sample(logits, None, None, None, *(pens or ()), block_v=block_v)
    for tokens in (mixed, all_greedy):
        assert ((tokens >= 0) & (tokens < v)).all(), tokens
    torch.testing.assert_close(x.gather(1, all_greedy[:, None])[:, 0], best, rtol=0, atol=0)
    torch.testing.assert_close(x.gather(1, mixed[:, None])[greedy, 0], best[greedy], rtol=0, atol=0)
    # Sampled rows draw a token the reference distribution can give (never a NaN or -inf one if another exists).
    chosen = probs.gather(1, mixed[:, None])[:, 0]
    assert (chosen[~greedy] > 0).all(), (mixed, kinds)
    nothing = best == float("-inf")
    assert (mixed[nothing] == 0).all() and (all_greedy[nothing] == 0).all()
    first_inf = (x == float("inf")).int().argmax(dim=1)
    has_inf = best == float("inf")
    assert torch.equal(mixed[has_inf], first_inf[has_inf]) and torch.equal(all_greedy[has_inf], first_inf[has_inf])


@given(seed=seeds(), v=st.sampled_from([64, 123]))
def test_noise_changes_with_seed_and_position(seed, v):
    # Flat logits: every token is equally likely, so 32 draws that all agree would mean the noise is stuck.
    draws = 32
    logits = torch.zeros(draws, v, device=DEVICE)
    temps = torch.ones(draws, device=DEVICE)
    same_seed = torch.full((draws,), seed, dtype=torch.int64, device=DEVICE)
    by_position = sample(logits, temps, same_seed, torch.arange(draws, device=DEVICE))
    by_seed = sample(logits, temps, same_seed + torch.arange(draws, device=DEVICE), torch.zeros_like(same_seed))
    assert by_position.unique().numel() > draws // 4
    assert by_seed.unique().numel() > draws // 4


def test_wrapper_rejects_bad_inputs():
    logits = torch.randn(3, 11, device=DEVICE)
    temps = torch.ones(3, device=DEVICE)
    seeds_ = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="logits must be"):
        sample(logits[0], temps, seeds_, seeds_)
    with pytest.raises(ValueError, match="logits must be float16"):
        sample(logits.to(torch.int32), temps, seeds_, seeds_)
    with pytest.raises(ValueError, match="contiguous"):
        sample(logits.t().contiguous().t(), temps, seeds_, seeds_)
    with pytest.raises(ValueError, match="temperature must be"):
        sample(logits, temps.double(), seeds_, seeds_)
    with pytest.raises(ValueError, match="seeds must be"):
        sample(logits, temps, seeds_[:2], seeds_)
    with pytest.raises(ValueError, match="needs seeds"):
        sample(logits, temps)
    with pytest.raises(ValueError, match="or none of them"):
        sample(logits, temps, seeds_, seeds_, prompt_mask=torch.zeros(3, 11, dtype=torch.bool, device=DEVICE))
    pens = penalty_inputs(3, 11, 0)
    with pytest.raises(ValueError, match="output_counts must be"):
        sample(logits, temps, seeds_, seeds_, pens[0], pens[1].long(), *pens[2:])
