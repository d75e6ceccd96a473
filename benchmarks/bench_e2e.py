"""End-to-end benchmark on a Llama-3.1-8B-shaped model with random weights (any CUDA GPU; not run by CI).

    python benchmarks/bench_e2e.py --out results/ [--num-prompts 1000] [--parts offline,decode,quant,hf]

The model is built from a config.json written to a temp dir (load_format="dummy": no weights are downloaded)
with a synthetic word-level tokenizer; prompts are token ids. In one run:
  offline  a seeded workload of --num-prompts requests, input/output lengths uniform in [0.5x, 1.5x] of 215 / 198
           tokens, ignore_eos (exact lengths), all submitted at once: requests/s, output and total tokens/s.
  hf       the first --hf-num-prompts requests of that workload through transformers generate() with static
           batches of --hf-batch-size (padded; useful tokens only), and tritonllm's speed-up over it.
  decode   one request decoding alone: tokens/s against the roofline, copy bandwidth (measured here) / bytes a
           step must read (weights + the KV cache of the average context); with CUDA graphs and eagerly.
  quant    the same for AWQ and GPTQ 4-bit variants (fp16, group size 128).
Each engine's start time (weights, KV-cache profiling and allocation, graph capture) is reported too, and the Triton
kernel variants compiled (or loaded from the disk cache) during the start and inside the timed offline run.
Writes e2e.json and e2e.md to --out. `--preset tiny` runs the whole script at toy size (also on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    add_kernel_override_args,
    apply_kernel_override_args,
    bench_device,
    compile_summary,
    copy_bandwidth_gbs,
    environment,
    kernel_compiles,
    log,
    markdown_table,
    write_results,
)
from e2e_setup import PRESETS, build_engine, kv_bytes_per_token, weight_bytes, write_model_dir  # noqa: E402
from hf_baseline import hf_static_batching  # noqa: E402

from tritonllm.entrypoints.bench import run_bench, synthetic_workload, warm_up  # noqa: E402
from tritonllm.sampling_params import SamplingParams  # noqa: E402

PARTS = ("offline", "hf", "decode", "quant")
INPUT_MEAN, OUTPUT_MEAN, RANGE_RATIO = 215, 198, 0.5
TARGETS = {"decode_roofline_fraction": 0.85, "offline_output_tokens_per_s": 12000, "speedup_vs_hf": 10.0}


def decode_alone(engine, prompt_len: int, output_len: int, seed: int) -> dict[str, float]:
    """One greedy request on an idle engine; per-token time of its decode steps (the prefill step excluded)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.model_config.vocab_size, (prompt_len,), generator=g).tolist()
    engine.add_request(None, prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len))
    stamps = []
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    steps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    per_token = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return {
        "tokens_per_s": 1 / per_token,
        "ms_per_token": per_token * 1e3,
        "step_ms_p50": steps[len(steps) // 2] * 1e3,
        "step_ms_p90": steps[int(len(steps) * 0.9)] * 1e3,
    }


def decode_vs_roofline(engine, args, bandwidth_gbs: float) -> list[dict[str, Any]]:
    """Batch-1 decode with CUDA graphs (when captured) and eagerly, against the bandwidth roofline."""
    weights = weight_bytes(engine.model)
    avg_context = args.decode_prompt_len + args.decode_output_len / 2
    kv = kv_bytes_per_token(engine) * avg_context
    roofline = bandwidth_gbs * 1e9 / (weights + kv)
    decode_alone(engine, 16, 8, args.seed)  # warm-up
    runner = engine.runner
    graphs = (runner.decode_graphs, runner.mixed_graphs)
    modes = [("cuda graphs", graphs), ("eager", (None, None))] if graphs[0] is not None else [("eager", graphs)]
    rows = []
    for mode, (decode_graphs, mixed_graphs) in modes:
        runner.decode_graphs, runner.mixed_graphs = decode_graphs, mixed_graphs
        try:
            r = decode_alone(engine, args.decode_prompt_len, args.decode_output_len, args.seed)
        finally:
            runner.decode_graphs, runner.mixed_graphs = graphs
        rows.append(
            {
                "mode": mode,
                **r,
                "weight_gb": weights / 1e9,
                "kv_mb_per_step": kv / 1e6,
                "roofline_tokens_per_s": roofline,
                "roofline_fraction": r["tokens_per_s"] / roofline,
            }
        )
        log(
            f"  batch-1 decode ({mode}): {r['tokens_per_s']:.1f} tok/s = {100 * rows[-1]['roofline_fraction']:.1f}% "
            f"of the {roofline:.1f} tok/s roofline"
        )
    return rows


def free_memory() -> None:
    """Give a finished engine's memory back before the next one profiles what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_variant(name: str, model_dir: Path, device, args, bandwidth: float, workload, offline: bool, decode: bool):
    log(f"{name}: starting the engine ...")
    with kernel_compiles() as compiled:
        engine, start = build_engine(model_dir, device, **engine_kwargs(args))
    start["kernel_compiles"] = compile_summary(compiled)
    log(
        f"{name}: engine up in {start['total_s']:.1f} s ({start['num_graphs']} graphs, "
        f"{start['kv_cache_gib']:.1f} GiB KV cache)"
    )
    limits = engine.scheduler.config
    result: dict[str, Any] = {
        "start": start,
        "max_num_seqs": limits.max_num_seqs,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
    }
    if decode:
        result["decode"] = decode_vs_roofline(engine, args, bandwidth)
    if offline:
        vocab = engine.model_config.vocab_size
        # Prompts shaped like the workload's, so that no kernel variant compiles (or loads from Triton's disk cache)
        # inside the timed run: with 16 warm-up requests the first fp16 engine of a process ran up to 30% slower
        # than the second on the same kernels (docs/benchmarks.md, thirteenth pass).
        n = args.warmup_prompts
        with kernel_compiles() as compiled:
            if n > 0:
                warm_up(engine, synthetic_workload(n, args.input_len, 8, RANGE_RATIO, vocab, args.seed + 1), n)
        warm_compiles = compile_summary(compiled)
        steps = {"all": 0, "graph": 0}
        execute = engine.runner.execute

        def counting_execute(out, *rest):
            steps["all"] += 1
            runner = engine.runner
            steps["graph"] += any(
                g is not None and g.can_run(out, *rest[:1]) for g in (runner.decode_graphs, runner.mixed_graphs)
            )
            return execute(out, *rest)

        engine.runner.execute = counting_execute
        log(f"{name}: offline workload of {len(workload)} requests ...")
        with kernel_compiles() as compiled:
            bench = run_bench(engine, workload, progress=True)
        del engine.runner.execute  # back to the class's method
        stats = engine.get_stats()
        result["offline"] = {
            **dataclasses.asdict(bench),
            "steps": steps["all"],
            "graph_steps": steps["graph"],
            "preemptions": stats.num_preemptions,
            "warmup_kernel_compiles": warm_compiles,
            "kernel_compiles": compile_summary(compiled),
        }
        log(f"{name}: {bench.output_tokens_per_s:,.0f} output tok/s, {bench.requests_per_s:.2f} req/s")
        for kernel, variants in result["offline"]["kernel_compiles"]["per_kernel"].items():
            log(f"  compiled in the timed run: {kernel} x{len(variants)}: {variants[0]}")
    return result


def engine_kwargs(args) -> dict[str, Any]:
    return {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "seed": args.seed,
    }


def report(results: dict[str, Any], args) -> str:
    env = results["environment"]
    variants = results["variants"]
    first = next(iter(variants.values()), {})  # the limits the engine resolved (flags, else its defaults)
    parts = [
        f"# End-to-end: {args.preset} shape, random weights",
        f"{env['device']} · torch {env['torch']} · triton {env['triton']} · commit {env.get('commit', '?')} · "
        f"{env['date']}",
        f"Copy bandwidth (read + write): **{results['copy_bandwidth_gbs']:,.0f} GB/s**. "
        f"max_model_len {args.max_model_len}, max_num_seqs {first.get('max_num_seqs', args.max_num_seqs)}, "
        f"max_num_batched_tokens {first.get('max_num_batched_tokens', args.max_num_batched_tokens)}, "
        f"async scheduling {'on' if args.async_scheduling else 'off'}.",
    ]
    offline = [(n, v["offline"]) for n, v in variants.items() if "offline" in v]
    if offline:
        rows = [
            [
                n,
                o["num_requests"],
                o["duration_s"],
                o["requests_per_s"],
                o["output_tokens_per_s"],
                o["total_tokens_per_s"],
                o["ttft_ms"]["mean"],
                o["tpot_ms"]["mean"],
                o["steps"],
                o["graph_steps"],
                o["preemptions"],
                o["kernel_compiles"]["variants"],
                o["kernel_compiles"]["seconds"],
            ]
            for n, o in offline
        ]
        parts += [
            f"## Offline throughput ({args.input_len}/{args.output_len} tokens in/out on average, uniform ±50%)",
            markdown_table(
                [
                    "variant",
                    "requests",
                    "s",
                    "req/s",
                    "output tok/s",
                    "total tok/s",
                    "TTFT ms",
                    "TPOT ms",
                    "steps",
                    "graph steps",
                    "preemptions",
                    "kernels compiled",
                    "compile s",
                ],
                rows,
            ),
        ]
    if "hf" in results:
        h = results["hf"]
        parts += [
            f"## transformers {h['transformers_version']} static batching (batch {h['batch_size']}, first "
            f"{h['num_requests']} requests, useful tokens only)",
            markdown_table(
                ["requests", "s", "req/s", "output tok/s", "total tok/s", "generated incl. padding"],
                [
                    [
                        h["num_requests"],
                        h["duration_s"],
                        h["requests_per_s"],
                        h["output_tokens_per_s"],
                        h["total_tokens_per_s"],
                        h["generated_tokens"],
                    ]
                ],
            ),
        ]
        if "speedup_vs_hf" in results:
            parts.append(f"tritonllm output tokens/s over transformers': **{results['speedup_vs_hf']:.1f}x**")
    decode = [(n, r) for n, v in variants.items() for r in v.get("decode", [])]
    if decode:
        parts += [
            f"## Batch-1 decode vs roofline ({args.decode_prompt_len} prompt + {args.decode_output_len} output tokens)",
            "Roofline = copy bandwidth / (weight bytes + KV bytes of the average context) per token.",
            markdown_table(
                [
                    "variant",
                    "mode",
                    "tok/s",
                    "ms/token",
                    "step p90 ms",
                    "weights GB",
                    "KV MB/step",
                    "roofline tok/s",
                    "of roofline",
                ],
                [
                    [
                        n,
                        r["mode"],
                        r["tokens_per_s"],
                        r["ms_per_token"],
                        r["step_ms_p90"],
                        r["weight_gb"],
                        r["kv_mb_per_step"],
                        r["roofline_tokens_per_s"],
                        f"{100 * r['roofline_fraction']:.1f}%",
                    ]
                    for n, r in decode
                ],
            ),
        ]
    parts += [
        "## Engine start (seconds; Triton compiles into its on-disk cache on a first run)",
        markdown_table(
            [
                "variant",
                "total",
                "weights",
                "KV profiling",
                "KV allocation",
                "graph capture",
                "graphs",
                "KV GiB",
                "KV tokens",
                "kernels compiled",
            ],
            [
                [
                    n,
                    s["total_s"],
                    s["load_s"],
                    s["kv_profile_s"],
                    s["kv_allocate_s"],
                    s["graph_capture_s"],
                    s["num_graphs"],
                    s["kv_cache_gib"],
                    s["kv_cache_tokens"],
                    s["kernel_compiles"]["variants"],
                ]
                for n, s in ((n, v["start"]) for n, v in variants.items())
            ],
        ),
    ]
    if results.get("targets"):
        parts += [
            "## Targets (reported, not asserted)",
            markdown_table(
                ["target", "wanted", "measured", "met"],
                [[t["name"], t["wanted"], t["measured"], "yes" if t["met"] else "no"] for t in results["targets"]],
            ),
        ]
    return "\n\n".join(parts)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    dense = results["variants"].get("bf16", {})
    graphs = [r for r in dense.get("decode", []) if r["mode"] == "cuda graphs"] or dense.get("decode", [])
    if graphs:
        out.append(
            {
                "name": "bf16 batch-1 decode, fraction of roofline",
                "wanted": TARGETS["decode_roofline_fraction"],
                "measured": graphs[0]["roofline_fraction"],
                "met": graphs[0]["roofline_fraction"] >= TARGETS["decode_roofline_fraction"],
            }
        )
    if "offline" in dense:
        tps = dense["offline"]["output_tokens_per_s"]
        out.append(
            {
                "name": "bf16 offline output tokens/s",
                "wanted": TARGETS["offline_output_tokens_per_s"],
                "measured": tps,
                "met": tps >= TARGETS["offline_output_tokens_per_s"],
            }
        )
    if "speedup_vs_hf" in results:
        s = results["speedup_vs_hf"]
        out.append(
            {
                "name": "speed-up over transformers static batching",
                "wanted": TARGETS["speedup_vs_hf"],
                "measured": s,
                "met": s >= TARGETS["speedup_vs_hf"],
            }
        )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_results", help="Directory for e2e.json / e2e.md.")
    p.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated subset of {', '.join(PARTS)}.")
    p.add_argument("--skip-hf", action="store_true", help="Leave out the transformers baseline.")
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS), help="Model shape.")
    p.add_argument("--num-prompts", type=int, default=1000, help="Requests of the offline workload.")
    p.add_argument(
        "--hf-num-prompts",
        type=int,
        default=256,
        help="The first N requests of the workload go through transformers (default 256: 4 batches of 64; the "
        "whole workload takes about as long as everything else together).",
    )
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--decode-output-len", type=int, default=512)
    p.add_argument("--input-len", type=int, default=INPUT_MEAN, help="Mean prompt length of the workload.")
    p.add_argument("--output-len", type=int, default=OUTPUT_MEAN, help="Mean output length of the workload.")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="Engine context length (default 4096; the workload needs 650)."
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="Default: the engine's.")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="Token budget per step (default: the engine's)."
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="No CUDA graphs anywhere.")
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=True, help="The engine's default: on."
    )
    p.add_argument("--quant-offline", action="store_true", help="Also run the offline workload on AWQ and GPTQ.")
    p.add_argument(
        "--warmup-prompts", type=int, default=256, help="Short requests run before each offline workload (default 256)."
    )
    p.add_argument(
        "--quant-methods", default="awq,gptq", help="4-bit variants in the order they run (default awq,gptq)."
    )
    add_kernel_override_args(p)
    p.add_argument("--device", default=None, help="Default: cuda when available.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    args.quant_methods = [x.strip() for x in args.quant_methods.split(",") if x.strip()]
    if set(args.quant_methods) - {"awq", "gptq"}:
        p.error(f"--quant-methods takes awq and gptq, got {args.quant_methods}")
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.skip_hf and "hf" in args.parts:
        args.parts.remove("hf")
    return args


def main() -> None:
    args = parse_args()
    apply_kernel_override_args(args)
    device = bench_device(args.device)
    config = PRESETS[args.preset]
    results: dict[str, Any] = {"environment": environment(device), "settings": vars(args), "variants": {}}
    log(f"copy bandwidth on {device} ...")
    results["copy_bandwidth_gbs"] = bandwidth = copy_bandwidth_gbs(device)
    log(f"copy bandwidth {bandwidth:,.0f} GB/s")
    if args.max_model_len is None:
        args.max_model_len = min(4096, config["max_position_embeddings"])
    workload = synthetic_workload(
        args.num_prompts, args.input_len, args.output_len, RANGE_RATIO, config["vocab_size"], args.seed
    )
    with tempfile.TemporaryDirectory(prefix="tritonllm-bench-") as tmp:
        root = Path(tmp)
        dense_dir = write_model_dir(root, "bf16", config)
        wants = set(args.parts)
        if wants & {"offline", "decode"}:
            results["variants"]["bf16"] = run_variant(
                "bf16", dense_dir, device, args, bandwidth, workload, "offline" in wants, "decode" in wants
            )
            free_memory()
        if "quant" in wants:
            for quant in args.quant_methods:
                results["variants"][quant] = run_variant(
                    quant,
                    write_model_dir(root, quant, config, quant),
                    device,
                    args,
                    bandwidth,
                    workload,
                    args.quant_offline,
                    True,
                )
                free_memory()
        if "hf" in wants:
            dtype = getattr(torch, config["torch_dtype"])
            results["hf"] = hf_static_batching(
                dense_dir, workload[: args.hf_num_prompts], args.hf_batch_size, dtype, device, log
            )
            dense = results["variants"].get("bf16", {}).get("offline")
            if dense:
                results["speedup_vs_hf"] = dense["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
    results["targets"] = targets(results)
    write_results(args.out, "e2e", results, report(results, args))


if __name__ == "__main__":
    main()
