"""Dense GEMV (tritonllm/kernels/dense_gemv.py) against F.linear at decode batch sizes (not run by CI).

    python benchmarks/bench_gemv.py --out results/ [--dtype bfloat16] [--ms 1,2,4,8,16] [--shapes qkv,o]
    python benchmarks/bench_gemv.py --sweep --out results/      # launch configs per (M, shape), ~4 min on an H200
    python benchmarks/bench_gemv.py --smoke                       # one tiny shape, CPU interpreter too

Shapes are Llama-3.1-8B's projections and LM head (K -> N). The default run prints, per M and shape, microseconds
per call of dense_gemv with its default launch and of F.linear (cuBLAS), timed as decode runs them: a CUDA graph
of calls over copies of the weight that together pass L2 (`stream_us`), so every call reads HBM and nothing waits
on the host; the bytes each must move (weight + x + y) over that time, that rate as a fraction of the copy
bandwidth measured in the same run, the speed-up over F.linear, and eager calls with L2 flushed (host launch
overhead included) for reference. For gate_up it also times the gated launch (the projection and SiLU-and-mul in
one kernel, `dense_gemv(activation="silu")`) against F.linear + silu_and_mul, the two kernels it replaces.
`--sweep` times a pruned grid of launches (stage 1: tile shapes with the automatic split-K; stage 2: the three
best with split_k 1, 2, 3, 4, 6, 8), checks each result against the fp32 reference, and prints the best per
(M, shape). Writes gemv.json / gemv.md (gemv_sweep.* for --sweep) to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    bench_device,
    copy_bandwidth_gbs,
    environment,
    log,
    markdown_table,
    stream_copies,
    stream_us,
    time_ms,
    write_results,
)

from tritonllm.kernels.activation import silu_and_mul  # noqa: E402
from tritonllm.kernels.dense_gemv import dense_gemv, dense_gemv_ref, gated_dense_gemv_ref  # noqa: E402
from tritonllm.kernels.dense_gemv_config import (  # noqa: E402
    MAX_TILE_NUMEL,
    GemvConfig,
    auto_split_k,
    block_m,
    gemv_config,
    k_span,
    num_sms,
)

SHAPES = {  # (K, N)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
MS = (1, 2, 4, 8, 16)
SMOKE_SHAPES = {"tiny": (96, 40), "gate_up": (96, 80)}  # gate_up: the gated row too
SMOKE_MS = (1, 5)
SPLITS = (1, 2, 3, 4, 6, 8)
_SMEM_LIMIT = 227 * 1024  # shared memory one Hopper CTA may use


def _tensors(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device=device).manual_seed(m * 7919 + n)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    return x, w


def _bytes(m: int, k: int, n: int, dtype: torch.dtype) -> int:
    return (n * k + m * k + m * n) * dtype.itemsize


def _describe(cfg: GemvConfig) -> str:
    path = "dot" if cfg.use_dot else "cuda"
    return f"{path} n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def _gemv_call(x: torch.Tensor, out: torch.Tensor, cfg: GemvConfig | None = None) -> Callable[[torch.Tensor], object]:
    return lambda w: dense_gemv(x, w, out=out, config=cfg)


def _linear_call(x: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda w: F.linear(x, w)


def gated_row(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> dict:
    """gate_up + SiLU-and-mul: the gated launch against F.linear + silu_and_mul, both timed over weight copies."""
    x, w = _tensors(m, k, n, dtype, device)
    y = dense_gemv(x, w, activation="silu")
    err = (y.float() - gated_dense_gemv_ref(x, w, "silu").float()).abs().max().item()
    out = torch.empty_like(y)
    weights = stream_copies(w)
    with torch.inference_mode():
        fused = stream_us(lambda wc: dense_gemv(x, wc, out=out, activation="silu"), weights, device)
        unfused = stream_us(lambda wc: silu_and_mul(F.linear(x, wc)), weights, device)
    log(f"M={m:<3} gate_up+silu  gated gemv {fused:8.1f} us  F.linear + silu_and_mul {unfused:8.1f} us  "
        f"x{unfused / fused:.2f}  (max err {err:.3g})")  # fmt: skip
    return {"m": m, "gated_gemv_us": fused, "f_linear_silu_and_mul_us": unfused, "max_abs_err": err}


def run_default(shapes, ms, dtype, device, bandwidth, rep_ms: float) -> dict:
    rows, records = [], []
    sms = num_sms(device.index or 0)
    for m in ms:
        for name, (k, n) in shapes.items():
            x, w = _tensors(m, k, n, dtype, device)
            cfg = gemv_config(m, n, k, dtype, sms)
            y = dense_gemv(x, w)
            err = (y.float() - dense_gemv_ref(x, w)).abs().max().item()
            out = torch.empty_like(y)
            weights = stream_copies(w)
            with torch.inference_mode():
                us = stream_us(_gemv_call(x, out), weights, device)
                us_torch = stream_us(_linear_call(x), weights, device)
                g_us = time_ms(functools.partial(dense_gemv, x, w, out=out), device, rep_ms=rep_ms) * 1e3
                g_us_torch = time_ms(functools.partial(F.linear, x, w), device, rep_ms=rep_ms) * 1e3
            del weights
            nbytes = _bytes(m, k, n, dtype)
            gbs, gbs_torch = nbytes / (us * 1e-6) / 1e9, nbytes / (us_torch * 1e-6) / 1e9
            records.append(
                {
                    "m": m, "shape": name, "k": k, "n": n, "bytes": nbytes, "config": dataclasses.asdict(cfg),
                    "gemv_us": us, "f_linear_us": us_torch, "gemv_gbs": gbs, "f_linear_gbs": gbs_torch,
                    "gemv_fraction_of_copy_bandwidth": gbs / bandwidth,
                    "f_linear_fraction_of_copy_bandwidth": gbs_torch / bandwidth,
                    "speedup_vs_f_linear": us_torch / us, "gemv_eager_flushed_us": g_us,
                    "f_linear_eager_flushed_us": g_us_torch,
                    "max_abs_err": err,
                }
            )  # fmt: skip
            rows.append(
                [m, name, us, us_torch, gbs, f"{100 * gbs / bandwidth:.0f}%", f"{100 * gbs_torch / bandwidth:.0f}%",
                 f"{us_torch / us:.2f}x", g_us, g_us_torch, _describe(cfg)]
            )  # fmt: skip
            log(
                f"M={m:<3} {name:>8}  gemv {us:8.1f} us ({100 * gbs / bandwidth:3.0f}% of copy)  "
                f"F.linear {us_torch:8.1f} us ({100 * gbs_torch / bandwidth:3.0f}%)  x{us_torch / us:.2f}  "
                f"[{_describe(cfg)}]"
            )
    headers = ["M", "shape", "gemv us", "F.linear us", "gemv GB/s", "gemv of copy bw", "F.linear of copy bw",
               "speedup", "gemv eager us", "F.linear eager us", "launch"]  # fmt: skip
    gated = [gated_row(m, *shapes["gate_up"], dtype, device) for m in ms] if "gate_up" in shapes else []
    gated_md = markdown_table(
        ["M", "gated gemv us", "F.linear + silu_and_mul us", "speedup"],
        [[g["m"], g["gated_gemv_us"], g["f_linear_silu_and_mul_us"],
          f"{g['f_linear_silu_and_mul_us'] / g['gated_gemv_us']:.2f}x"] for g in gated],
    )  # fmt: skip
    markdown = markdown_table(headers, rows) + ("\n\ngate_up + SiLU-and-mul:\n\n" + gated_md if gated else "")
    return {"results": records, "gated": gated, "markdown": markdown}


def sweep_candidates(m: int, dtype: torch.dtype) -> list[GemvConfig]:
    """Tile configs worth timing at M rows (split_k 1; stage 2 tries the others). CUDA cores up to 8 rows, BLOCK_K
    one or two CTA spans (`k_span`) and 16-128 fp32 accumulators per thread; tl.dot with the stages that fit
    shared memory. Pruned of launches that spill registers when compiled for sm_90."""
    out: list[GemvConfig] = []
    bm = block_m(m, False)
    if m <= 8:
        for warps in (2, 4, 8):
            span = k_span(dtype, warps)
            for block_k in (span, 2 * span) if warps < 8 else (span,):
                for block_n in (1, 2, 4, 8, 16):
                    acc = bm * block_n * block_k // (32 * warps)  # fp32 registers per thread
                    tile = block_n * block_k // (32 * warps) * dtype.itemsize // 4  # weight tile, registers
                    if not (16 <= acc <= 128 and bm * block_n * block_k <= MAX_TILE_NUMEL):
                        continue
                    for stages in (1, 2) if acc + tile <= 160 else (1,):  # a prefetched tile beyond spills on sm_90
                        out.append(GemvConfig(block_n, block_k, 1, warps, stages, False))
    for block_n in (16, 32, 64):
        for block_k in (128, 256, 512) if block_n == 64 else (128, 256):  # narrower tiles at 512 spill
            for warps in (4, 8) if block_n == 64 else (4,):
                for stages in (2, 3, 4):
                    if stages * (block_n + 16) * block_k * dtype.itemsize <= _SMEM_LIMIT:
                        out.append(GemvConfig(block_n, block_k, 1, warps, stages, True))
    return out


def _time_config(x, w, out, cfg, expected, tol, weights) -> float | None:
    """Milliseconds per call, or None when the launch fails or its result is wrong."""
    try:
        y = dense_gemv(x, w, out=out, config=cfg)
        err = (y.float() - expected).abs().max().item()
        if err > tol:
            log(f"  {_describe(cfg)}: WRONG RESULT (max err {err:.3g})")
            return None
        return stream_us(_gemv_call(x, out, cfg), weights, x.device) / 1e3
    except Exception as e:  # a launch that does not compile or run (shared memory, registers) is skipped
        log(f"  {_describe(cfg)}: {type(e).__name__}: {str(e)[:120]}")
        return None


def run_sweep(shapes, ms, dtype, device, bandwidth, rep_ms: float, limit: int = 0) -> dict:
    best_rows, results = [], []
    sms = num_sms(device.index or 0)
    start = time.perf_counter()
    for m in ms:
        candidates = sweep_candidates(m, dtype)[: limit or None]
        for name, (k, n) in shapes.items():
            x, w = _tensors(m, k, n, dtype, device)
            expected = dense_gemv_ref(x, w)
            tol = 2e-2 * expected.abs().max().item() + 1e-3
            out = torch.empty(m, n, dtype=dtype, device=device)
            weights = stream_copies(w)
            linear_ms = stream_us(_linear_call(x), weights, device) / 1e3
            default = gemv_config(m, n, k, dtype, sms)
            default_ms = _time_config(x, w, out, default, expected, tol, weights)
            timed = [(default_ms, default)] if default_ms is not None else []
            stage1 = []
            for cand in candidates:
                cfg = dataclasses.replace(cand, split_k=auto_split_k(cand, n, k, dtype.itemsize, sms))
                t = _time_config(x, w, out, cfg, expected, tol, weights)
                if t is not None:
                    stage1.append((t, cfg))
            stage1.sort(key=lambda r: r[0])
            timed += stage1
            for _, cfg in stage1[:3]:
                for split in SPLITS:
                    if split != cfg.split_k and (split == 1 or split * 2 * cfg.block_k <= k):
                        cand = dataclasses.replace(cfg, split_k=split)
                        t = _time_config(x, w, out, cand, expected, tol, weights)
                        if t is not None:
                            timed.append((t, cand))
            timed.sort(key=lambda r: r[0])
            if not timed:
                log(f"sweep M={m} {name}: no launch ran")
                continue
            best_ms, best = timed[0]
            gbs = _bytes(m, k, n, dtype) / (best_ms * 1e-3) / 1e9
            results += [
                {"m": m, "shape": name, "us": t * 1e3, "config": dataclasses.asdict(c), "default": c == default}
                for t, c in timed
            ]
            best_rows.append(
                [m, name, linear_ms * 1e3, default_ms * 1e3 if default_ms else float("nan"), best_ms * 1e3,
                 f"{100 * gbs / bandwidth:.0f}%", f"{linear_ms / best_ms:.2f}x", _describe(best), _describe(default)]
            )  # fmt: skip
            log(
                f"sweep M={m} {name}: best {_describe(best)} {best_ms * 1e3:.1f} us ({100 * gbs / bandwidth:.0f}% of "
                f"copy), default {best_rows[-1][3]:.1f} us, F.linear {linear_ms * 1e3:.1f} us, {len(timed)} timed, "
                f"{time.perf_counter() - start:.0f} s so far"
            )
    headers = ["M", "shape", "F.linear us", "default us", "best us", "best of copy bw", "F.linear / best",
               "best launch", "default launch"]  # fmt: skip
    return {"best": best_rows, "all": results, "markdown": markdown_table(headers, best_rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results", help="directory for gemv.json / .md")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated row counts M")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {','.join(SHAPES)}")
    parser.add_argument("--sweep", action="store_true", help="time the candidate launches instead (~4 min)")
    parser.add_argument("--rep-ms", type=float, default=None, help="measuring time per case (default 100; sweep 10)")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape, a few launches (CPU interpreter too)")
    parser.add_argument("--device", default=None, help="default: cuda, or the CPU interpreter without a GPU")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = bench_device(args.device)
    if args.smoke:
        shapes, ms = SMOKE_SHAPES, SMOKE_MS
    else:
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
        ms = tuple(int(v) for v in args.ms.split(","))
    rep_ms = args.rep_ms or (10 if args.sweep or args.smoke else 100)
    env = environment(device)
    log(f"{env['device']} ({num_sms(device.index or 0)} SMs), {args.dtype}; copy bandwidth ...")
    bandwidth = copy_bandwidth_gbs(device)
    log(f"copy bandwidth {bandwidth:,.0f} GB/s")
    if args.sweep:
        res = run_sweep(shapes, ms, dtype, device, bandwidth, rep_ms, limit=4 if args.smoke else 0)
    else:
        res = run_default(shapes, ms, dtype, device, bandwidth, rep_ms)
    title = "Dense GEMV launch sweep" if args.sweep else "Dense GEMV vs F.linear"
    md = "\n\n".join(
        [
            f"# {title}, Llama-3.1-8B shapes" if not args.smoke else f"# {title} (smoke)",
            f"{env['device']} · torch {env['torch']} · triton {env['triton']} · {args.dtype} · "
            f"commit {env.get('commit', '?')} · {env['date']}",
            f"Copy bandwidth (read + write): **{bandwidth:,.0f} GB/s**. GB/s = (weight + x + y bytes) / time; "
            "calls timed as CUDA graph replays over weight copies that together pass L2 (eager columns: L2 "
            "flushed).",
            res["markdown"],
        ]
    )
    res.update(environment=env, dtype=args.dtype, copy_bandwidth_gbs=bandwidth)
    write_results(args.out, "gemv_sweep" if args.sweep else "gemv", res, md)


if __name__ == "__main__":
    main()
