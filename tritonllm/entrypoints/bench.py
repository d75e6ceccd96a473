"""Offline throughput benchmark: a seeded synthetic workload of random token ids through one engine.

Prompt and output lengths are drawn uniformly from [mean * (1 - range_ratio), mean * (1 + range_ratio)];
outputs ignore EOS, so every request generates exactly its drawn length. Requests arrive all at once
(request_rate = inf) or as a seeded Poisson process. Per request: TTFT = first token - arrival (queueing
included), TPOT = (last token - first token) / (output tokens - 1).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from tqdm.auto import tqdm

from tritonllm.runtime.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival: float  # seconds after the start


@dataclass(slots=True)
class BenchResult:
    num_requests: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)  # mean, p50, p90, p99
    tpot_ms: dict[str, float] = field(default_factory=dict)


def synthetic_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    request_rate: float = math.inf,
    excluded_ids: set[int] = frozenset(),
) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must lie in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or num_prompts < 1:
        raise ValueError("num_prompts, input_len and output_len must all be >= 1")
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in excluded_ids]

    def length(mean: int) -> int:
        return rng.randint(max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio))))

    requests, t = [], 0.0
    for _ in range(num_prompts):
        prompt = [rng.choice(allowed) for _ in range(length(input_len))]
        requests.append(BenchRequest(prompt, length(output_len), t))
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
    return requests


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    mean = sum(ms) / len(ms) if ms else math.nan
    return {"mean": mean, "p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def warm_up(engine: LLMEngine, workload: list[BenchRequest], num_requests: int) -> None:
    """Run a few short requests first, so kernel compilation is not timed."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    for r in workload[:num_requests]:
        engine.add_request(None, r.prompt_token_ids, params)
    while engine.has_unfinished_requests():
        engine.step()


def run_bench(engine: LLMEngine, workload: list[BenchRequest], progress: bool = True) -> BenchResult:
    pending = sorted(workload, key=lambda r: r.arrival)
    first_token: dict[str, float] = {}
    finished: dict[str, tuple[float, int]] = {}  # request id -> (time of the last token, output tokens)
    arrival: dict[str, float] = {}
    next_index = 0
    bar = tqdm(total=len(workload), desc="Requests", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    while next_index < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(pending) and pending[next_index].arrival <= now:
            r = pending[next_index]
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
            request_id = engine.add_request(None, r.prompt_token_ids, params)
            arrival[request_id] = start + r.arrival
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[next_index].arrival - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            if out.outputs[0].token_ids and out.request_id not in first_token:
                first_token[out.request_id] = t
            if out.finished:
                finished[out.request_id] = (t, len(out.outputs[0].token_ids))
                bar.update(1)
    duration = time.perf_counter() - start
    bar.close()

    ttft = [first_token[i] - arrival[i] for i in finished]
    tpot = [(finished[i][0] - first_token[i]) / (finished[i][1] - 1) for i in finished if finished[i][1] > 1]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    output_tokens = sum(n for _, n in finished.values())
    return BenchResult(
        num_requests=len(finished),
        duration_s=duration,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        requests_per_s=len(finished) / duration,
        output_tokens_per_s=output_tokens / duration,
        total_tokens_per_s=(prompt_tokens + output_tokens) / duration,
        ttft_ms=summary_ms(ttft),
        tpot_ms=summary_ms(tpot),
    )


def format_result(r: BenchResult) -> str:
    def row(name: str, s: dict[str, float]) -> str:
        return f"{name:<10}mean {s['mean']:10.2f}   p50 {s['p50']:10.2f}   p90 {s['p90']:10.2f}   p99 {s['p99']:10.2f}"

    return "\n".join(
        [
            f"Requests:      {r.num_requests} in {r.duration_s:.2f} s "
            f"({r.prompt_tokens} prompt tokens, {r.output_tokens} output tokens)",
            f"Throughput:    {r.requests_per_s:.2f} requests/s, {r.output_tokens_per_s:.2f} output tokens/s, "
            f"{r.total_tokens_per_s:.2f} total tokens/s",
            row("TTFT (ms)", r.ttft_ms),
            row("TPOT (ms)", r.tpot_ms),
        ]
    )


def write_json(path: str, result: BenchResult, settings: dict) -> None:
    """Results plus the settings that produced them; figures that do not exist (nan) are written as null."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return x

    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean({**asdict(result), "settings": settings}), f, indent=2, allow_nan=False, default=str)
