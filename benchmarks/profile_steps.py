"""Where a step's time goes: kernel breakdown (torch.profiler) and wall vs GPU time per engine step (not run by CI).

    python benchmarks/profile_steps.py --out results/                     # 8B shape: batch-1 decode, offline steps
    python benchmarks/profile_steps.py --out /tmp/smoke --preset tiny     # toy model, any device
    python benchmarks/profile_steps.py --out results/ --quant awq         # the AWQ 4-bit variant

Two phases on the Llama-3.1-8B shape with dummy weights, each timed without the profiler first (wall ms per step),
then profiled over the same number of steps for the kernels:
- decode: one request alone on the engine (CUDA-graph replays), as batch-1 decode runs;
- offline: the synthetic offline workload (1000 requests arriving at once, as bench_e2e.py runs it), a window
  of steps taken once the batch is full, so mixed steps (a prefill chunk next to decodes) dominate.
Per phase: wall ms per step, GPU kernel ms per step (their sum: one stream), tokens per step, and the kernels
by time per step. Writes profile.json and profile.md to --out.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    add_kernel_override_args,
    apply_kernel_override_args,
    bench_device,
    environment,
    log,
    markdown_table,
    write_results,
)
from e2e_setup import PRESETS, QUANT_CONFIGS, build_engine, write_model_dir  # noqa: E402

from tritonllm.entrypoints.bench import synthetic_workload, warm_up  # noqa: E402
from tritonllm.sampling_params import SamplingParams  # noqa: E402

TOP_KERNELS = 25


def short_name(name: str) -> str:
    """Kernel names without template arguments and signatures, so instances of one kernel add up."""
    name = re.sub(r"<.*>", "", name)
    name = re.sub(r"\(.*\)", "", name)
    return name.strip()[:90]


class StepCounter:
    """Counts the tokens each step runs, through the runner's execute."""

    def __init__(self, engine) -> None:
        self.tokens: list[int] = []
        runner = engine.runner
        execute = runner.execute

        def counting(out, *rest):
            self.tokens.append(out.num_batched_tokens)
            return execute(out, *rest)

        runner.execute = counting


def timed_steps(engine, num_steps: int) -> list[float]:
    times = []
    for _ in range(num_steps):
        if not engine.has_unfinished_requests():
            break
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def profiled_steps(engine, device: torch.device, num_steps: int) -> tuple[int, dict[str, tuple[int, float]]]:
    """(steps run, {kernel: (calls, total us)}) over `num_steps` profiled steps."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        steps = len(timed_steps(engine, num_steps))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        k = kernels[short_name(e.name)]
        k[0] += 1
        k[1] += e.time_range.elapsed_us()
    return steps, {name: (int(c), us) for name, (c, us) in kernels.items()}


def phase_report(name: str, wall: list[float], tokens: list[int], steps: int, kernels) -> dict[str, Any]:
    gpu_us = sum(us for _, us in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    result = {
        "phase": name,
        "steps_timed": len(wall),
        "wall_ms_per_step": 1e3 * sum(wall) / max(1, len(wall)),
        "wall_ms_p50": 1e3 * sorted(wall)[len(wall) // 2] if wall else float("nan"),
        "tokens_per_step": sum(tokens) / max(1, len(tokens)),
        "steps_profiled": steps,
        "gpu_ms_per_step": gpu_us / 1e3 / max(1, steps),
        "kernels": [
            {"kernel": k, "calls_per_step": c / max(1, steps), "us_per_step": us / max(1, steps), "share": us / gpu_us}
            for k, (c, us) in top
        ],
    }
    log(
        f"{name}: {result['wall_ms_per_step']:.2f} ms wall/step (p50 {result['wall_ms_p50']:.2f}), "
        f"{result['gpu_ms_per_step']:.2f} ms GPU kernels/step, {result['tokens_per_step']:.0f} tokens/step"
    )
    for k in result["kernels"][:10]:
        log(f"  {k['us_per_step']:9.1f} us/step {100 * k['share']:5.1f}% x{k['calls_per_step']:.0f}  {k['kernel']}")
    return result


def decode_phase(engine, device, args, counter: StepCounter) -> dict[str, Any]:
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, engine.model_config.vocab_size, (args.prompt_len,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4 + 3 * args.steps)
    engine.add_request(None, prompt, params)
    timed_steps(engine, 4)  # prefill and the first decodes
    counter.tokens.clear()
    wall = timed_steps(engine, args.steps)
    tokens = list(counter.tokens)
    steps, kernels = profiled_steps(engine, device, args.steps)
    while engine.has_unfinished_requests():
        engine.step()
    return phase_report("batch-1 decode", wall, tokens, steps, kernels)


def offline_phase(engine, device, args, counter: StepCounter) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    warm_up(engine, synthetic_workload(16, args.input_len, 8, 0.5, vocab, args.seed + 1), 16)
    request_ids = [
        engine.add_request(
            None, r.prompt_token_ids, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
        )
        for r in synthetic_workload(args.num_prompts, args.input_len, args.output_len, 0.5, vocab, args.seed)
    ]
    timed_steps(engine, args.offline_skip_steps)  # fill the batch
    counter.tokens.clear()
    wall = timed_steps(engine, args.steps)
    tokens = list(counter.tokens)
    steps, kernels = profiled_steps(engine, device, args.steps)
    for request_id in request_ids:  # the rest of the workload is not needed
        engine.abort_request(request_id)
    return phase_report("offline steps", wall, tokens, steps, kernels)


def render(results: dict[str, Any]) -> str:
    env = results["environment"]
    variant = f", {results['quant']}" if results["quant"] else ""
    parts = [
        f"# Step profile: {results['preset']} shape{variant}, random weights",
        f"{env['device']} · torch {env['torch']} · triton {env['triton']} · commit {env.get('commit', '?')} · "
        f"{env['date']}",
    ]
    for p in results["phases"]:
        parts += [
            f"## {p['phase']}: {p['wall_ms_per_step']:.2f} ms wall per step (p50 {p['wall_ms_p50']:.2f}), "
            f"{p['gpu_ms_per_step']:.2f} ms of GPU kernels per step, {p['tokens_per_step']:.0f} tokens per step",
            markdown_table(
                ["kernel", "calls/step", "us/step", "share of GPU time"],
                [
                    [k["kernel"], k["calls_per_step"], k["us_per_step"], f"{100 * k['share']:.1f}%"]
                    for k in p["kernels"]
                ],
            ),
        ]
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="Directory for profile.json / profile.md.")
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--quant", default=None, choices=sorted(QUANT_CONFIGS), help="A 4-bit variant of the preset.")
    p.add_argument("--phases", default="decode,offline", help="Comma-separated subset of decode, offline.")
    p.add_argument("--steps", type=int, default=30, help="Steps timed, then as many profiled, per phase.")
    p.add_argument("--prompt-len", type=int, default=512, help="Prompt of the batch-1 decode phase.")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=215)
    p.add_argument("--output-len", type=int, default=198)
    p.add_argument("--offline-skip-steps", type=int, default=150, help="Offline steps run before the window.")
    p.add_argument("--max-num-seqs", type=int, default=None, help="Default: the engine's.")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="Default: the engine's.")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-model-len", type=int, default=None, help="Default: 4096 or the model's limit if lower.")
    add_kernel_override_args(p)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    device = bench_device(args.device)
    apply_kernel_override_args(args)
    results: dict[str, Any] = {
        "environment": environment(device), "preset": args.preset, "quant": args.quant, "phases": []
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config = PRESETS[args.preset]
        model_dir = write_model_dir(Path(tmp), args.preset, config, args.quant)
        args.max_model_len = args.max_model_len or min(4096, config["max_position_embeddings"])
        engine, start = build_engine(
            model_dir,
            device,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=args.async_scheduling,
            seed=args.seed,
        )
        log(f"engine up in {start['total_s']:.1f} s")
        phases = {"decode": decode_phase, "offline": offline_phase}
        counter = StepCounter(engine)
        for name in args.phases.split(","):
            results["phases"].append(phases[name](engine, device, args, counter))
    write_results(args.out, "profile", results, render(results))


if __name__ == "__main__":
    main()
