"""Launch heuristics of the fused quantized GEMM (tritonllm/kernels/quant_gemm.py), all in one place."""

import functools
from dataclasses import dataclass

import torch
import triton

from tritonllm.platform import INTERPRET


@dataclass(slots=True, frozen=True)
class QuantGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of the GPU; a small stand-in under the interpreter, which runs programs in turn."""
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def quant_gemm_config(m: int, n: int, k: int, group_size: int, sms: int | None = None) -> QuantGemmConfig:
    """Every launch heuristic of the fused GEMM in one place (`sms`: the GPU's SM count, default the current one).

    BLOCK_K divides the group size when it can, so a K tile reads one row of scales and zeros. Small M (decode)
    splits K until the grid covers the SMs about twice: the kernel is bound by reading the packed weight, and a
    batch of one has only cdiv(N, BLOCK_N) tiles otherwise. Large M runs unsplit with wide tiles.
    """
    sms = sms or num_sms()
    group = k if group_size == -1 else group_size
    block_k = next((b for b in (128, 64, 32, 16) if group % b == 0 or group >= k), 32)
    if m <= 16:
        block_m, block_n = 16, 64
        num_warps, num_stages = 4, 4
    elif m <= 64:
        block_m, block_n, block_k = (32 if m <= 32 else 64), 64, min(block_k, 64)
        num_warps, num_stages = 4, 4
    else:
        block_m, block_n, block_k = (64 if m <= 128 else 128), 128, min(block_k, 64)
        num_warps, num_stages = 8, 3
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = 1
    if m <= 64:
        # Each split keeps at least 4 K tiles so the fp32 workspace round trip stays small next to the weights.
        split_k = max(1, min(2 * sms // tiles, triton.cdiv(k, block_k) // 4, 16))
    return QuantGemmConfig(block_m, block_n, block_k, split_k, num_warps, num_stages)
