"""Elementwise kernels at Llama-3.1-8B shapes against the copy bandwidth measured in the same run (not run by CI).

    python benchmarks/bench_elementwise.py --out results/ [--dtype bfloat16] [--tokens 1,16,128,1024,4096,16384]

Ops: RMSNorm (hidden 4096), fused residual add + RMSNorm, neox RoPE on q/k views of a fused qkv output
(32 query and 8 KV heads of 128), SiLU-and-mul ([T, 2 x 14336] -> [T, 14336]). For each token count: microseconds
per call (median, L2 flushed between calls), the bytes the op must move divided by that time, that rate as a
fraction of the copy bandwidth, and the same op written in eager PyTorch for scale.
Writes elementwise.json and elementwise.md to --out.
"""

from __future__ import annotations

import argparse
import sys
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
    time_ms,
    write_results,
)

from tritonllm.kernels.activation import silu_and_mul  # noqa: E402
from tritonllm.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from tritonllm.kernels.rope import apply_rotary  # noqa: E402
from tritonllm.models.layers.rotary import get_rope  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
MAX_POSITION = 8192
EPS = 1e-5


def _torch_rope(positions, q, k, cache):
    cos, sin = cache[positions].chunk(2, dim=-1)  # [T, 64] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        x1, x2 = x[..., : HEAD_DIM // 2].float(), x[..., HEAD_DIM // 2 :].float()
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def cases(t: int, dtype: torch.dtype, device: torch.device) -> dict[str, tuple[Callable, Callable, int]]:
    """op -> (tritonllm call, eager PyTorch call, bytes the op must read + write)."""
    e = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device).manual_seed(t)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    x, residual, weight = randn(t, HIDDEN), randn(t, HIDDEN), randn(HIDDEN)
    gate_up = randn(t, 2 * INTERMEDIATE)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = randn(t, q_size + 2 * kv_size)  # q and k are strided views, as in the model
    q = qkv[:, :q_size].view(t, HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(t, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=g, device=device)
    cache = get_rope(HEAD_DIM, HEAD_DIM, MAX_POSITION, 500000.0).cos_sin_cache.to(device)

    def silu_torch():
        return F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]

    return {
        "rms_norm": (
            lambda: rms_norm(x, weight, EPS),
            lambda: F.rms_norm(x, (HIDDEN,), weight, EPS),
            (2 * t * HIDDEN + HIDDEN) * e,
        ),
        # Reads x and residual, writes residual (in place) and the output.
        "fused_add_rms_norm": (
            lambda: fused_add_rms_norm(x, residual, weight, EPS),
            lambda: F.rms_norm(residual.add_(x), (HIDDEN,), weight, EPS),
            (4 * t * HIDDEN + HIDDEN) * e,
        ),
        # Reads and writes q and k in place; reads one cos/sin row (fp32) and one position per token.
        "rope": (
            lambda: apply_rotary(positions, q, k, cache, True),
            lambda: _torch_rope(positions, q, k, cache),
            2 * t * (HEADS + KV_HEADS) * HEAD_DIM * e + t * HEAD_DIM * 4 + t * 8,
        ),
        "silu_and_mul": (
            lambda: silu_and_mul(gate_up),
            silu_torch,
            3 * t * INTERMEDIATE * e,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results", help="Directory for elementwise.json / .md.")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--tokens", default="1,16,128,1024,4096,16384", help="Comma-separated token counts.")
    parser.add_argument("--device", default=None, help="Default: cuda when available (CPU runs the interpreter).")
    parser.add_argument("--rep-ms", type=float, default=100, help="Measuring time per case (ms).")
    args = parser.parse_args()
    device = bench_device(args.device)
    dtype = getattr(torch, args.dtype)
    tokens = [int(t) for t in args.tokens.split(",")]

    log(f"copy bandwidth on {device} ...")
    bandwidth = copy_bandwidth_gbs(device)
    log(f"copy bandwidth {bandwidth:,.0f} GB/s")
    rows, records = [], []
    for t in tokens:
        for op, (ours, eager, nbytes) in cases(t, dtype, device).items():
            with torch.inference_mode():
                us = time_ms(ours, device, rep_ms=args.rep_ms) * 1e3
                us_torch = time_ms(eager, device, rep_ms=args.rep_ms) * 1e3
            gbs = nbytes / (us * 1e-6) / 1e9
            record = {
                "op": op,
                "tokens": t,
                "bytes": nbytes,
                "us": us,
                "gb_per_s": gbs,
                "fraction_of_copy_bandwidth": gbs / bandwidth,
                "torch_eager_us": us_torch,
                "speedup_vs_torch_eager": us_torch / us,
            }
            records.append(record)
            rows.append([op, t, us, gbs, f"{100 * gbs / bandwidth:.0f}%", us_torch, f"{us_torch / us:.2f}x"])
            log(f"{op:>20} T={t:<6} {us:9.1f} us  {gbs:8.0f} GB/s  ({100 * gbs / bandwidth:.0f}% of copy)")

    env = environment(device)
    md = "\n\n".join(
        [
            "# Elementwise kernels, Llama-3.1-8B shapes",
            f"{env['device']} · torch {env['torch']} · triton {env['triton']} · {args.dtype} · "
            f"commit {env.get('commit', '?')} · {env['date']}",
            f"Copy bandwidth (read + write): **{bandwidth:,.0f} GB/s**. GB/s = bytes the op must move / time.",
            markdown_table(
                ["op", "tokens", "us", "GB/s", "of copy bw", "torch eager us", "speedup"],
                rows,
            ),
        ]
    )
    results = {"environment": env, "dtype": args.dtype, "copy_bandwidth_gbs": bandwidth, "results": records}
    write_results(args.out, "elementwise", results, md)


if __name__ == "__main__":
    main()
