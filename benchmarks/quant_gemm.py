"""GPU benchmark of the quantized GEMM against the dense matmul and against dequantize + matmul (not run by CI).

    python benchmarks/quant_gemm.py [--dtype float16] [--group-size 128]

Shapes are Llama-3-8B's projections (K, N); M runs from decode (1) to prefill. Prints microseconds per call,
the packed-weight bandwidth (GB/s, what bounds decode) and TFLOP/s (what bounds prefill).
"""

import argparse

import torch
import triton

from tritonllm.kernels.quant_dequant import gptq_dequantize
from tritonllm.kernels.quant_gemm import awq_gemm, gptq_gemm
from tritonllm.quant.pack import pack_awq_int, pack_bits

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
BATCHES = (1, 8, 32, 128, 512, 2048)


def _tensors(k: int, n: int, group_size: int, device: str):
    groups = k // group_size
    ints = torch.randint(0, 16, (k, n), device=device)
    zeros = torch.randint(0, 16, (groups, n), device=device)
    scales = (torch.rand(groups, n, device=device) * 0.01).to(torch.float16)
    awq = (pack_awq_int(ints), pack_awq_int(zeros), scales)
    gptq = (pack_bits(ints, 4, dim=0), pack_bits(zeros, 4, dim=1), scales)
    return awq, gptq


def _bench(x, dense, awq, gptq, perm, g, dtype) -> list[float]:
    """Milliseconds per call: dense matmul, AWQ, GPTQ, GPTQ act-order, GPTQ dequantize + matmul."""
    (aq, az, as_), (gq, gz, gs) = awq, gptq
    calls = (
        lambda: x @ dense,
        lambda: awq_gemm(x, aq, az, as_, g),
        lambda: gptq_gemm(x, gq, gz, gs, 4, g, 1),
        lambda: gptq_gemm(x, gq, gz, gs, 4, g, 1, perm),
        lambda: x @ gptq_dequantize(gq, gz, gs, None, 4, g, 1, dtype=dtype),
    )
    return [triton.testing.do_bench(fn) for fn in calls]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = "cuda"
    g = args.group_size
    print(
        f"{'shape':>8} {'M':>5} | {'dense us':>9} {'awq us':>8} {'gptq us':>8} {'act-ord us':>10} {'deq+mm us':>9}"
        f" | {'awq GB/s':>8} {'awq TF/s':>8}"
    )
    for name, (k, n) in SHAPES.items():
        (aq, az, as_), (gq, gz, gs) = _tensors(k, n, g, device)
        dense = torch.randn(k, n, device=device, dtype=dtype)
        perm = torch.randperm(k, device=device).to(torch.int32)
        packed_bytes = aq.numel() * 4 + az.numel() * 4 + as_.numel() * 2
        for m in BATCHES:
            x = torch.randn(m, k, device=device, dtype=dtype)
            times = _bench(x, dense, (aq, az, as_), (gq, gz, gs), perm, g, dtype)
            us = [t * 1e3 for t in times]
            gbs = packed_bytes / (times[1] * 1e-3) / 1e9
            tfs = 2 * m * k * n / (times[1] * 1e-3) / 1e12
            print(
                f"{name:>8} {m:>5} | {us[0]:>9.1f} {us[1]:>8.1f} {us[2]:>8.1f} {us[3]:>10.1f} {us[4]:>9.1f}"
                f" | {gbs:>8.0f} {tfs:>8.1f}"
            )


if __name__ == "__main__":
    main()
