import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DEVICE, seeds
from tritonllm.runtime.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)
from tritonllm.sampling_params import SamplingParams


def build_metadata(params, prompts, outputs, vocab_size, **kwargs) -> SamplingMetadata:
    """SamplingMetadata of rows given as prompt and output lists."""
    token_ids = [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)]
    return SamplingMetadata.build(params, token_ids, [len(p) for p in prompts], vocab_size, **kwargs)


vocab_sizes = st.sampled_from([5, 64, 123, 1151])


def _logits(n: int, v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def _histories(n: int, v: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, v, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    outputs = [
        torch.randint(0, v, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    return prompts, outputs


def _penalized_ref(logits: torch.Tensor, params, prompts, outputs) -> torch.Tensor:
    """vLLM's penalties, one token at a time."""
    out = logits.clone().cpu()
    for r, p in enumerate(params):
        for t in set(prompts[r]) | set(outputs[r]):
            x = out[r, t]
            out[r, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(outputs[r]):
            out[r, t] -= p.frequency_penalty * outputs[r].count(t) + p.presence_penalty
    return out


def _filter_ref(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens a row may draw: min_p, then top_k, then top_p, on a temperature-scaled row."""
    probs = torch.softmax(x, 0)
    allowed = {i for i in range(len(x)) if probs[i] >= min_p * probs.max()}
    order = sorted(allowed, key=lambda i: -x[i].item())
    if top_k > 0:
        order = [i for i in order if x[i] >= x[order[min(top_k, len(order)) - 1]]]
    p = torch.softmax(x[order], 0)
    kept, mass = [], 0.0
    for i, pi in zip(order, p.tolist(), strict=True):
        kept.append(i)
        mass += pi
        if mass >= top_p - 1e-6:
            break
    return set(kept)


@given(seed=seeds(), v=vocab_sizes)
def test_metadata_build(seed, v):
    prompts, outputs = _histories(4, v, seed)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(seed=2**64 - 1, repetition_penalty=1.2, top_k=3),
        SamplingParams(seed=7, frequency_penalty=0.5, logprobs=2),
        SamplingParams(top_p=0.5, stop_token_ids=[1], min_tokens=100, max_tokens=None, ignore_eos=True, logprobs=4),
    ]
    meta = build_metadata(params, prompts, outputs, v, eos_token_id=0, sample_indices=[0, 1, 2, 0], device=DEVICE)
    assert meta.positions.tolist() == [len(a) + len(b) for a, b in zip(prompts, outputs, strict=True)]
    assert meta.temperature.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert meta.seeds.tolist()[1:3] == [0, 9]  # seed + sample index, wrapped to 64 bits
    assert meta.seeded.tolist() == [False, True, True, False] and meta.any_unseeded and not meta.all_greedy
    assert meta.top_k.tolist() == [v, 3, v, v] and meta.top_p.tolist() == [1.0, 1.0, 1.0, 0.5]
    assert meta.min_p is None and meta.max_num_logprobs == min(4, v)
    for r in (1, 2):
        assert meta.prompt_mask[r].nonzero().flatten().tolist() == sorted(set(prompts[r]))
        assert meta.output_counts[r].tolist() == [outputs[r].count(t) for t in range(v)]
    banned = set(zip(meta.banned_rows.tolist(), meta.banned_tokens.tolist(), strict=True))
    assert banned == ({(0, 0)} if len(outputs[0]) < 3 else set()) | {(3, 1)}


@given(seed=seeds(), v=vocab_sizes, data=st.data())
def test_pending_tokens_count_as_if_the_host_held_them(seed, v, data):
    # Asynchronous scheduling: a row's last output token may still be on the device (sampled by the step before).
    n = 5
    prompts, outputs = _histories(n, v, seed)
    pending = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    g = torch.Generator().manual_seed(seed)
    last = torch.randint(0, v, (n,), generator=g).tolist()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=3, frequency_penalty=-0.7, min_tokens=4, stop_token_ids=[0]),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(seed=5, repetition_penalty=0.8),
    ]
    held = [o + [t] if p else o for o, t, p in zip(outputs, last, pending, strict=True)]
    expected = build_metadata(params, prompts, held, v, eos_token_id=0, device=DEVICE)
    on_device = torch.tensor([t for t, p in zip(last, pending, strict=True) if p], device=DEVICE)
    meta = build_metadata(
        params, prompts, outputs, v, eos_token_id=0, num_pending=[int(p) for p in pending],
        pending_token_ids=on_device, device=DEVICE,
    )  # fmt: skip
    for name in ("positions", "prompt_mask", "banned_rows", "banned_tokens"):
        a, b = getattr(meta, name), getattr(expected, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    penalized = [0, 2, 3, 4]  # the kernel reads no other row's counts
    assert torch.equal(meta.output_counts[penalized], expected.output_counts[penalized])
    logits = _logits(n, v, seed)
    assert torch.equal(Sampler()(logits, meta).sampled_token_ids, Sampler()(logits, expected).sampled_token_ids)


def test_pending_tokens_of_penalized_rows_are_required():
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams()]
    with pytest.raises(ValueError, match="pass pending_token_ids"):
        build_metadata(params, [[1, 2], [3]], [[4], []], 8, num_pending=[1, 0])
    with pytest.raises(ValueError, match="at most one token pending"):
        build_metadata(params, [[1, 2], [3]], [[4], []], 8, num_pending=[0, 2])
    # Without penalties the pending tokens matter only for positions and min_tokens.
    meta = build_metadata([SamplingParams(), SamplingParams()], [[1, 2], [3]], [[4], []], 8, num_pending=[1, 1])
    assert meta.positions.tolist() == [4, 2] and meta.output_counts is None


@given(seed=seeds(), n=st.sampled_from([1, 6, 17]), v=vocab_sizes)
def test_greedy_rows_are_argmax_of_penalized_logits(seed, n, v):
    prompts, outputs = _histories(n, v, seed)
    g = torch.Generator().manual_seed(seed)
    params = [
        SamplingParams(
            temperature=0.0,
            repetition_penalty=float(torch.rand(1, generator=g)) + 0.5,
            presence_penalty=float(torch.rand(1, generator=g)) * 2 - 1,
            frequency_penalty=float(torch.rand(1, generator=g)) * 2 - 1,
        )
        for _ in range(n)
    ]
    logits = _logits(n, v, seed)
    meta = build_metadata(params, prompts, outputs, v, device=DEVICE)
    tokens = Sampler()(logits, meta).sampled_token_ids
    assert tokens.tolist() == _penalized_ref(logits, params, prompts, outputs).argmax(dim=1).tolist()


@given(
    seed=seeds(),
    v=st.sampled_from([64, 123]),
    top_k=st.sampled_from([-1, 1, 4, 17]),
    top_p=st.sampled_from([1.0, 0.3, 0.8]),
    min_p=st.sampled_from([0.0, 0.1]),
    temperature=st.sampled_from([0.5, 1.3]),
)
def test_filtered_rows_draw_only_allowed_tokens(seed, v, top_k, top_p, min_p, temperature):
    draws = 64
    row = _logits(1, v, seed)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    prompts, outputs = [[0]] * draws, [[1] * i for i in range(draws)]  # one request at 64 positions
    meta = build_metadata([params] * draws, prompts, outputs, v, device=DEVICE)
    tokens = Sampler()(row.expand(draws, v).contiguous(), meta).sampled_token_ids
    allowed = _filter_ref(row[0].cpu() / temperature, top_k, top_p, min_p)
    assert set(tokens.tolist()) <= allowed
    kept = torch.tensor(sorted(allowed))
    if torch.softmax(row[0].cpu()[kept] / temperature, 0).max() < 0.7:
        # 64 equal draws would have probability < 0.7^63: the rows must still be sampling.
        assert len(set(tokens.tolist())) > 1


@given(
    seed=seeds(),
    v=st.sampled_from([64, 123]),
    top_k=st.sampled_from([-1, 1, 4]),
    top_p=st.sampled_from([1.0, 0.3]),
    min_p=st.sampled_from([0.0, 0.1]),
)
def test_filters_treat_nan_logits_as_minus_inf(seed, v, top_k, top_p, min_p):
    # An overflowing fp16 model yields NaN logits. The filters must rank NaN last, as the draw does: a NaN left in
    # the row turns softmax (top_p, min_p) and the k-th largest logit (top_k) into NaN, and nothing gets filtered.
    draws = 32
    row = _logits(1, v, seed)
    nan = torch.rand(v, generator=torch.Generator().manual_seed(seed)) < 0.3
    nan[int(row[0].cpu().argmax())] = False  # a finite best token, so top_k = 1 has one answer
    row[0, nan.to(DEVICE)] = float("nan")
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    prompts, outputs = [[0]] * draws, [[1] * i for i in range(draws)]
    meta = build_metadata([params] * draws, prompts, outputs, v, device=DEVICE)
    tokens = Sampler()(row.expand(draws, v).contiguous(), meta).sampled_token_ids.tolist()
    allowed = _filter_ref(torch.where(nan, float("-inf"), row[0].cpu()), top_k, top_p, min_p)
    assert set(tokens) <= allowed - set(torch.nonzero(nan)[:, 0].tolist())


@given(seed=seeds(), v=st.sampled_from([5, 64, 1151]))
def test_top_k_top_p_min_p_match_per_row_reference(seed, v):
    n = 6
    x = _logits(n, v, seed)
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, v + 1, (n,), generator=g)
    p = torch.rand(n, generator=g) * 0.9 + 0.1
    m = torch.rand(n, generator=g) * 0.2
    filtered = apply_top_k_top_p(apply_min_p(x, m.to(DEVICE)), k.to(DEVICE), p.to(DEVICE))
    for r in range(n):
        kept = set(torch.isfinite(filtered[r]).nonzero().flatten().tolist())
        assert kept == _filter_ref(x[r].cpu(), int(k[r]), float(p[r]), float(m[r]))
        assert torch.equal(filtered[r][list(kept)], x[r][list(kept)])


@given(seed=seeds(), temperature=st.sampled_from([0.7, 1.5]))
def test_filtered_distribution_is_renormalized(seed, temperature):
    # top_k=3 of 7 tokens: the three survivors must be drawn in proportion to their softmax.
    draws, v = 6000, 7
    row = torch.linspace(-1.5, 1.5, v)[torch.randperm(v, generator=torch.Generator().manual_seed(seed))].to(DEVICE)
    params = SamplingParams(temperature=temperature, top_k=3)
    prompts, outputs = [[0]] * draws, [[]] * draws
    meta = build_metadata([params] * draws, prompts, outputs, v, device=DEVICE)
    tokens = Sampler(seed=seed)(row.expand(draws, v).contiguous(), meta).sampled_token_ids.cpu()
    top = row.cpu().topk(3).indices
    counts = torch.bincount(tokens, minlength=v)
    assert counts.sum() == counts[top].sum()
    expected = torch.softmax(row.cpu()[top] / temperature, 0).double() * draws
    chi2 = float(((counts[top].double() - expected) ** 2 / expected).sum())
    assert chi2 < 27.6  # chi-square quantile at 1 - 1e-6 with 2 degrees of freedom


@given(seed=seeds(), v=vocab_sizes)
def test_seeded_requests_reproduce_alone_or_batched(seed, v):
    n = 5
    prompts, outputs = _histories(n, v, seed)
    params = [
        SamplingParams(seed=seed + r, temperature=1.0, repetition_penalty=1.1 if r % 2 else 1.0) for r in range(n)
    ]
    logits = _logits(n, v, seed, scale=0.3)
    batched = Sampler(seed=1)(logits, build_metadata(params, prompts, outputs, v, device=DEVICE))
    for r in range(n):
        # Alone, with a different engine seed and after other steps: same token.
        sampler = Sampler(seed=2)
        sampler(logits, build_metadata([SamplingParams()] * n, prompts, outputs, v, device=DEVICE))
        alone = sampler(
            logits[r : r + 1],
            build_metadata(params[r : r + 1], prompts[r : r + 1], outputs[r : r + 1], v, device=DEVICE),
        )
        assert alone.sampled_token_ids.item() == batched.sampled_token_ids[r].item()


@given(seed=seeds())
def test_unseeded_rows_follow_the_engine_seed(seed):
    n, v = 32, 123
    logits = _logits(n, v, seed, scale=0.1)
    meta = build_metadata([SamplingParams()] * n, [[0]] * n, [[]] * n, v, device=DEVICE)
    first = Sampler(seed=seed)(logits, meta).sampled_token_ids
    assert torch.equal(Sampler(seed=seed)(logits, meta).sampled_token_ids, first)
    assert not torch.equal(Sampler(seed=seed + 1)(logits, meta).sampled_token_ids, first)


@given(seed=seeds(), v=vocab_sizes)
def test_warm_up_leaves_the_engine_seed_stream_alone(seed, v):
    n = 16
    logits = _logits(n, v, seed, scale=0.1)
    meta = build_metadata([SamplingParams(temperature=0.7)] * n, [[0]] * n, [[]] * n, v, device=DEVICE)
    warmed = Sampler(seed=seed)
    warmed.warm_up(v, DEVICE)
    cpu_state = torch.get_rng_state()
    assert torch.equal(warmed(logits, meta).sampled_token_ids, Sampler(seed=seed)(logits, meta).sampled_token_ids)
    warmed.warm_up(v, DEVICE)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # nor torch's global one


@given(seed=seeds(), v=vocab_sizes, k=st.sampled_from([0, 1, 5]))
def test_logprobs_are_raw_with_sampled_token_and_rank(seed, v, k):
    n = 4
    logits = _logits(n, v, seed)
    prompts, outputs = _histories(n, v, seed)
    params = [
        SamplingParams(temperature=0.0, logprobs=k),
        SamplingParams(temperature=3.0, repetition_penalty=1.8, logprobs=k),
        SamplingParams(temperature=0.5, top_k=2, min_tokens=9, logprobs=k),
        SamplingParams(seed=3),
    ]
    out = Sampler(seed=seed)(logits, build_metadata(params, prompts, outputs, v, eos_token_id=0, device=DEVICE))
    raw = torch.log_softmax(logits.double(), dim=1)
    lp = out.logprobs
    k = min(k, v)
    assert lp.token_ids.shape == (n, k + 1) and lp.logprobs.shape == (n, k + 1)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lp.logprobs.double(), raw.gather(1, lp.token_ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(lp.token_ids[:, 1:], raw.topk(k, dim=1).indices)
    chosen = raw.gather(1, out.sampled_token_ids[:, None])
    assert lp.ranks.tolist() == (1 + (raw > chosen).sum(dim=1)).tolist()
    assert lp.ranks[0] == 1  # greedy on unpenalized logits picks the top token


@given(seed=seeds(), v=vocab_sizes)
def test_min_tokens_bans_stop_tokens_until_reached(seed, v):
    logits = _logits(3, v, seed)
    logits[:, 0] = 100.0  # EOS dominates
    logits[:, 1 % v] = 90.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1 % v])
    eos = frozenset({0, 2 % v})  # several EOS ids, as Llama 3 lists
    meta = build_metadata([params] * 3, [[2]] * 3, [[], [3], [3, 3]], v, eos_token_id=eos, device=DEVICE)
    tokens = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert tokens[0] not in (0, 1 % v, 2 % v) and tokens[1] not in (0, 1 % v, 2 % v)
    assert tokens[2] == 0


@given(seed=seeds(), v=vocab_sizes, k=st.sampled_from([0, 2, 7]), p=st.sampled_from([1, 9, 33]))
def test_prompt_logprobs(seed, v, k, p):
    logits = _logits(p, v, seed)
    targets = torch.randint(0, v, (p,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    out = compute_prompt_logprobs(logits, targets, k)
    raw = torch.log_softmax(logits.double(), dim=1)
    k = min(k, v)
    assert torch.equal(out.token_ids[:, 0], targets)
    torch.testing.assert_close(out.logprobs.double(), raw.gather(1, out.token_ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(out.token_ids[:, 1:], raw.topk(k, dim=1).indices)
    expected_ranks = [1 + int((raw[i] > raw[i, targets[i]]).sum()) for i in range(p)]
    assert out.ranks.tolist() == expected_ranks
    assert math.isclose(
        float(out.logprobs[:, 0].exp().sum()), float(raw.gather(1, targets[:, None]).exp().sum()), rel_tol=1e-4
    )
