"""GPU benchmark of the fused W4A16 GEMM against the dense matmul and dequantize + matmul (not run by CI).

    python benchmarks/quant_gemm.py [--dtype float16] [--group-size 128] [--out results/]
    python benchmarks/quant_gemm.py --sweep [--sweep-ms 1,4,16,64,128,512,2048]   # launch configs for the table

Shapes are Llama-3.1-8B's projections (K, N); M runs from decode (1) to prefill. The default run prints, per
shape and M, microseconds per call of the dense matmul (cuBLAS), the W4A16 GEMM's default launch (GPTQ layout with
regular groups: what GPTQ and repacked AWQ checkpoints run), its tl.dot kernel, GPTQ act-order, dequantize + matmul
(the many-rows path) and the general dequantize kernel + matmul; dense / W4A16 (the targets:
>= 3x at M <= 16, >= 1x at M = 128), the packed-weight bandwidth and TFLOP/s; and the one-time AWQ repack per
shape. Each call is timed as a model step runs it: CUDA graph replays over copies of the weights that together
exceed L2 (bench_utils.stream_us), so no host time and no L2 flush enters the figures. `--sweep` times every
candidate launch of `sweep_candidates` (stage 1 with the automatic split-K, stage 2 the three best with each split
of `sweep_splits`), checks each result against the default launch's, and prints the best per (M, shape) plus
`HOPPER_TABLE` rows to paste into tritonllm/kernels/quant_gemm_config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    bench_device,
    environment,
    fixed_and_rate,
    log,
    markdown_table,
    stream_copies,
    stream_us,
    sync,
    write_results,
)

from tritonllm.kernels.quant_dequant import gptq_dequantize  # noqa: E402
from tritonllm.kernels.quant_gemm import gptq_gemm  # noqa: E402
from tritonllm.kernels.quant_gemm_config import (  # noqa: E402
    DEQUANT_CONFIG,
    M_BUCKETS,
    QuantGemmConfig,
    auto_split_k,
    num_sms,
    quant_gemm_config,
    sweep_candidates,
    sweep_splits,
)
from tritonllm.kernels.quant_gemv_f16 import paired_gemv_applies  # noqa: E402
from tritonllm.quant.pack import pack_awq_int, pack_bits, repack_awq_as_gptq  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
BATCHES = (1, 4, 16, 32, 128, 256, 512, 2048)
SWEEP_MS = (1, 4, 16, 64, 128, 512, 2048)
# --preset tiny: a toy size that runs anywhere (the CPU interpreter too), to check the script itself.
TINY_SHAPES = {"tiny": (256, 64)}
TINY_BATCHES = (1, 17)


def _tensors(k: int, n: int, group_size: int, device: str):
    """GPTQ-layout 4-bit weights (zero offset 0, as repacked AWQ) and the matching AWQ tensors."""
    groups = k // group_size
    ints = torch.randint(0, 16, (k, n), device=device)
    zeros = torch.randint(0, 16, (groups, n), device=device)
    scales = (torch.rand(groups, n, device=device) * 0.01).to(torch.float16)
    gptq = (pack_bits(ints, 4, dim=0), pack_bits(zeros, 4, dim=1), scales)
    awq = (pack_awq_int(ints), pack_awq_int(zeros))
    return gptq, awq


# The tl.dot kernel's launch where the default is dequantize + matmul: one 128-row tile, close to the H200 table's
# launch for gate_up at 65-128 rows.
FUSED_LARGE = QuantGemmConfig(128, 128, 64, 1, 8, 3)


def _calls(x, perm, g, cfg):
    """Per column, the call on one weight copy: a dense W^T for "dense", else the packed (qweight, qzeros, scales)."""
    dot = FUSED_LARGE if cfg.dequant else cfg
    return {
        "dense": lambda w: x @ w,
        "w4a16": lambda t: gptq_gemm(x, *t, 4, g, 0),
        "dot": lambda t: gptq_gemm(x, *t, 4, g, 0, config=dot),
        "act_order": lambda t: gptq_gemm(x, *t, 4, g, 0, perm),
        "deq_mm": lambda t: gptq_gemm(x, *t, 4, g, 0, config=DEQUANT_CONFIG),
        "deq_mm_general": lambda t: x @ gptq_dequantize(*t, None, 4, g, 0, dtype=x.dtype),
    }


def run_default(shapes, batches, dtype: torch.dtype, g: int, sms: int, device: torch.device) -> dict:
    rows, results = [], []
    for name, (k, n) in shapes.items():
        (qw, qz, s), (aq, az) = _tensors(k, n, g, device)
        sync(device)
        start = time.perf_counter()
        repacked = repack_awq_as_gptq(aq, az)
        sync(device)
        repack_ms = (time.perf_counter() - start) * 1e3
        assert torch.equal(repacked[0], qw) and torch.equal(repacked[1], qz)
        del aq, az, repacked
        dense = stream_copies(torch.randn(k, n, device=device, dtype=dtype))
        packed = stream_copies((qw, qz, s))
        perm = torch.randperm(k, device=device).to(torch.int32)
        packed_bytes = qw.numel() * 4 + qz.numel() * 4 + s.numel() * 2
        for m in batches:
            x = torch.randn(m, k, device=device, dtype=dtype)
            cfg = quant_gemm_config(m, n, k, 4, sms, paired_gemv_applies(dtype, s.dtype, 4, g, k))
            us = {
                key: stream_us(fn, dense if key == "dense" else packed, device)
                for key, fn in _calls(x, perm, g, cfg).items()
            }
            r = {
                "shape": name,
                "m": m,
                **{f"{key}_us": v for key, v in us.items()},
                "dense_over_w4a16": us["dense"] / us["w4a16"],
                "packed_bytes": packed_bytes,
                "dense_bytes": k * n * dense[0].element_size(),
                "w4a16_gbs": packed_bytes / (us["w4a16"] * 1e-6) / 1e9,
                "w4a16_tflops": 2 * m * k * n / (us["w4a16"] * 1e-6) / 1e12,
                "config": dataclasses.asdict(cfg),
                "awq_repack_ms": repack_ms,
            }
            results.append(r)
            rows.append(
                [name, m, us["dense"], us["w4a16"], us["dot"], us["act_order"], us["deq_mm"], us["deq_mm_general"],
                 r["dense_over_w4a16"], r["w4a16_gbs"], r["w4a16_tflops"], _describe(cfg)]
            )  # fmt: skip
            ratio = r["dense_over_w4a16"]
            log(f"{name:>8} M={m:<5} dense {us['dense']:8.1f} us  w4a16 {us['w4a16']:8.1f} us  x{ratio:.2f}")
        log(f"{name}: AWQ repack at load {repack_ms:.1f} ms")
    headers = [
        "shape", "M", "dense us", "w4a16 us", "dot us", "act-order us", "deq+mm us", "general deq+mm us",
        "dense/w4a16", "GB/s", "TFLOP/s",
    ]  # fmt: skip
    md = markdown_table(headers + ["launch"], rows)
    fits = _fits(results)
    if fits:
        fit_headers = ["M", "w4a16 fixed us", "w4a16 GB/s", "dense fixed us", "dense GB/s"]
        md += "\n\nPer M over the shapes, us = fixed + bytes / rate (least squares):\n\n" + markdown_table(
            fit_headers,
            [[f[k] for k in ("m", "w4a16_fixed_us", "w4a16_gbs", "dense_fixed_us", "dense_gbs")] for f in fits],
        )
    return {"results": results, "fits": fits, "markdown": md}


def _fits(results: list[dict]) -> list[dict]:
    """Per M timed on two or more shapes: the W4A16 and dense times as a fixed cost plus a rate over the bytes each
    reads (packed weights with zeros and scales; the dense W^T)."""
    fits = []
    for m in dict.fromkeys(r["m"] for r in results):
        mine = [r for r in results if r["m"] == m]
        if len({r["packed_bytes"] for r in mine}) < 2:
            continue
        fit = {"m": m}
        for kind, size in (("w4a16", "packed_bytes"), ("dense", "dense_bytes")):
            fixed, gbs = fixed_and_rate([r[size] for r in mine], [r[f"{kind}_us"] for r in mine])
            fit |= {f"{kind}_fixed_us": fixed, f"{kind}_gbs": gbs}
        log(
            f"fit M={m}: w4a16 {fit['w4a16_fixed_us']:.2f} us + {fit['w4a16_gbs']:,.0f} GB/s | "
            f"dense {fit['dense_fixed_us']:.2f} us + {fit['dense_gbs']:,.0f} GB/s"
        )
        fits.append(fit)
    return fits


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _describe(cfg: QuantGemmConfig) -> str:
    if cfg.dequant:
        return f"dequant+mm n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps}"
    kind = f"gemv m{cfg.block_m}" if cfg.gemv else f"{'swap' if cfg.swap_ab else 'dot'} m{cfg.block_m}"
    return f"{kind} n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def _with_split(cfg: QuantGemmConfig, m: int, n: int, k: int, sms: int, split: int | None = None):
    if cfg.dequant:
        return cfg
    if split is None:
        split = auto_split_k(m, _cdiv(m, cfg.block_m), _cdiv(n, cfg.block_n), k, cfg.block_k, sms)
    return dataclasses.replace(cfg, split_k=split)


def _time_config(x, packed, g, cfg, expected) -> float | None:
    """Milliseconds per call over the weight copies `packed`, or None when the launch fails or disagrees with the
    default launch's result."""
    try:
        y = gptq_gemm(x, *packed[0], 4, g, 0, config=cfg)
        if not torch.allclose(y.float(), expected, atol=3e-2, rtol=3e-2):
            log(f"  {_describe(cfg)}: WRONG RESULT (max err {(y.float() - expected).abs().max().item():.3g})")
            return None
        return stream_us(lambda t: gptq_gemm(x, *t, 4, g, 0, config=cfg), packed, x.device) / 1e3
    except Exception as e:  # a config that does not compile or launch (shared memory, registers) is skipped
        log(f"  {_describe(cfg)}: {type(e).__name__}: {str(e)[:100]}")
        return None


def run_sweep(shapes, ms, dtype: torch.dtype, g: int, sms: int, device: torch.device, limit: int = 0) -> dict:
    best_rows, rules, results = [], [], []
    for m in ms:
        bucket = next(b for b in M_BUCKETS if b[0] <= m <= b[1])
        for name, (k, n) in shapes.items():
            packed = stream_copies(_tensors(k, n, g, device)[0])
            paired = paired_gemv_applies(dtype, packed[0][2].dtype, 4, g, k)
            x = torch.randn(m, k, device=device, dtype=dtype)
            expected = gptq_gemm(x, *packed[0], 4, g, 0).float()
            dense = stream_copies(torch.randn(k, n, device=device, dtype=dtype))
            dense_ms = stream_us(lambda w, x=x: x @ w, dense, device) / 1e3
            default = quant_gemm_config(m, n, k, 4, sms, paired)
            default_ms = _time_config(x, packed, g, default, expected)
            stage1 = []
            for cand in sweep_candidates(m, paired)[: limit or None]:
                cfg = _with_split(cand, m, n, k, sms)
                t = _time_config(x, packed, g, cfg, expected)
                if t is not None:
                    stage1.append((t, cfg))
            stage1.sort(key=lambda r: r[0])
            timed = list(stage1)
            for _, cfg in [r for r in stage1 if not r[1].dequant][:3]:
                for split in sweep_splits(m, _cdiv(m, cfg.block_m), _cdiv(n, cfg.block_n), k, cfg.block_k, sms):
                    if split != cfg.split_k:
                        cand = _with_split(cfg, m, n, k, sms, split)
                        t = _time_config(x, packed, g, cand, expected)
                        if t is not None:
                            timed.append((t, cand))
            timed.sort(key=lambda r: r[0])
            if not timed:
                log(f"sweep M={m} {name}: no candidate ran")
                continue
            best_ms, best = timed[0]
            results += [{"m": m, "shape": name, "ms": t, "config": dataclasses.asdict(c)} for t, c in timed]
            best_rows.append(
                [m, name, dense_ms * 1e3, default_ms * 1e3 if default_ms else float("nan"), best_ms * 1e3,
                 dense_ms / best_ms, _describe(best)]
            )  # fmt: skip
            extra = ", paired_only=True" if paired and best.gemv else ""
            rules.append(
                f"    LaunchRule(m={bucket}, n=({n}, {n}), k=({k}, {k}), config=QuantGemmConfig({best.block_m}, "
                f"{best.block_n}, {best.block_k}, {best.split_k}, {best.num_warps}, {best.num_stages}, "
                f"gemv={best.gemv}, dequant={best.dequant}, swap_ab={best.swap_ab}){extra}),  "
                f"# M={m} {name}: {best_ms * 1e3:.1f} us, dense / this {dense_ms / best_ms:.2f}"
            )
            log(f"sweep M={m} {name}: best {_describe(best)} {best_ms * 1e3:.1f} us (dense {dense_ms * 1e3:.1f} us)")
    headers = ["M", "shape", "dense us", "default us", "best us", "dense/best", "best launch"]
    md = markdown_table(headers, best_rows)
    md += "\n\nHOPPER_TABLE rows (one per swept M; widen the M and N/K ranges by hand where neighbours agree):\n\n"
    md += "```python\nHOPPER_TABLE: tuple[LaunchRule, ...] = (\n" + "\n".join(rules) + "\n)\n```"
    return {"best": best_rows, "all": results, "markdown": md}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sweep", action="store_true", help="time the candidate launches instead (minutes)")
    parser.add_argument("--sweep-ms", default=",".join(map(str, SWEEP_MS)), help="M values the sweep times")
    parser.add_argument("--ms", default=",".join(map(str, BATCHES)), help="M values the default run times")
    parser.add_argument("--out", default=None, help="also write quant_gemm.json / .md here")
    parser.add_argument("--device", default=None, help="default: cuda, or the CPU interpreter without a GPU")
    parser.add_argument("--preset", default="llama8b", choices=["llama8b", "tiny"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = bench_device(args.device)
    sms = num_sms(device.index or 0)
    tiny = args.preset == "tiny"
    shapes, batches = (TINY_SHAPES, TINY_BATCHES) if tiny else (SHAPES, tuple(int(v) for v in args.ms.split(",")))
    g = 64 if tiny else args.group_size
    log(f"{environment(device)['device']} ({sms} SMs), {args.dtype}, group size {g}")
    if args.sweep:
        ms = TINY_BATCHES if tiny else tuple(int(v) for v in args.sweep_ms.split(","))
        res = run_sweep(shapes, ms, dtype, g, sms, device, limit=3 if tiny else 0)
    else:
        res = run_default(shapes, batches, dtype, g, sms, device)
    res["environment"] = environment(device)
    if args.out:
        write_results(args.out, "quant_gemm_sweep" if args.sweep else "quant_gemm", res, res["markdown"])
    else:
        print(res["markdown"], flush=True)


if __name__ == "__main__":
    main()
