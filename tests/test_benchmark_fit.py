"""The benchmarks' split of a launch's time into a fixed cost and a streaming rate (benchmarks/bench_utils.py)."""

import math
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_utils import fixed_and_rate  # noqa: E402

MB = 1 << 20
sizes = st.lists(st.integers(1, 4096).map(lambda m: m * MB), min_size=2, max_size=8, unique=True)


@given(fixed=st.floats(0.5, 50), gbs=st.floats(100, 10_000), nbytes=sizes)
def test_exact_times_give_back_their_fixed_cost_and_rate(fixed, gbs, nbytes):
    us = [fixed + b / (gbs * 1e3) for b in nbytes]
    got_fixed, got_gbs = fixed_and_rate(nbytes, us)
    assert got_fixed == pytest.approx(fixed, rel=1e-6, abs=1e-6)
    assert got_gbs == pytest.approx(gbs, rel=1e-6)


@given(nbytes=sizes, data=st.data())
def test_noisy_times_get_the_least_squares_line(nbytes, data):
    us = [data.draw(st.floats(1, 1000)) for _ in nbytes]
    fixed, gbs = fixed_and_rate(nbytes, us)
    slope = 0.0 if math.isinf(gbs) else 1e-3 / gbs
    residuals = [t - fixed - slope * b for b, t in zip(nbytes, us, strict=True)]
    scale = max(us)
    # The normal equations: residuals sum to zero and are orthogonal to the sizes (a slope <= 0 is clipped: then
    # the line is the mean time, whose residuals only sum to zero).
    assert sum(residuals) == pytest.approx(0, abs=1e-9 * scale * len(us))
    if not math.isinf(gbs):
        weighted = sum(r * b / MB for r, b in zip(residuals, nbytes, strict=True))
        assert weighted == pytest.approx(0, abs=1e-6 * scale * sum(b / MB for b in nbytes))


def test_times_that_do_not_grow_have_no_finite_rate():
    assert fixed_and_rate([MB, 2 * MB], [5.0, 5.0]) == (5.0, math.inf)


@pytest.mark.parametrize("nbytes", [[MB], [MB, MB, MB]])
def test_one_size_is_refused(nbytes):
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fixed_and_rate(nbytes, [1.0] * len(nbytes))
