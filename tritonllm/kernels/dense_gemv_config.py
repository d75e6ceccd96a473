"""Launch heuristics of the dense GEMV (tritonllm/kernels/dense_gemv.py) and when linear layers use it.

At a few rows a dense linear layer is bound by reading its weight once: what counts is enough bytes in flight
to keep DRAM busy (several programs per SM, wide loads), not arithmetic. Two compute paths:
  * CUDA cores (`use_dot=False`, the default at one row on a GPU): a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator in
    registers. It keeps the weight load's register layout only when BLOCK_K covers a whole CTA's 16-byte loads
    along K (`k_span`: 16 bytes x 32 lanes x warps), so no shared-memory layout conversion runs per tile; each
    thread then holds BLOCK_M * BLOCK_N * BLOCK_K / (32 * warps) accumulators. Triton's software pipeline does
    not touch these loads: num_stages > 1 instead loads each weight tile one iteration ahead, in registers.
  * tl.dot (`use_dot=True`, the default from two rows): the weight tile is the MMA's M side (BLOCK_N >= 16; 64
    makes it one wgmma per warpgroup), the rows padded to 16 its N side, and Triton's software pipeline keeps
    num_stages tiles in flight through shared memory.
Split-K fills the GPU when the N tiles alone are too few (its partial sums are added inside the launch): up to
`_PROGRAMS_PER_SM` programs per SM for the CUDA-core path, one wave of resident programs for the tl.dot path,
whose shared-memory stages allow only one or two per SM (more, shorter programs would leave its pipeline idle).

On the interpreter every Triton op costs the same whatever its size, so its launch is the fewest, largest
programs. Every decision reads Python ints only (shapes, the SM count), never tensor contents: launches are
captured in CUDA graphs. `benchmarks/bench_gemv.py --sweep` times the alternatives on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from tritonllm.kernels.dependent_launch import dependent_launch
from tritonllm.platform import INTERPRET

MAX_GEMV_ROWS = 16  # dense_gemv's limit: the rows fit one 16-row MMA tile
# Linear layers take the GEMV kernel for up to DENSE_GEMV_MAX_ROWS rows (x.numel() // K) and weights of at most
# DENSE_GEMV_MAX_WEIGHT elements (None: any), F.linear (cuBLAS) otherwise; 0 rows: never. The gated MLP's
# [gate; up] projection takes the same rows with its activation fused in (dense_gemv(activation=...)), up to
# GATED_GEMV_MAX_WEIGHT elements: besides the projection it saves the activation kernel and the [M, 2I]
# intermediate. On an H200 with programmatic dependent launch (bench_gemv.py, M = 1, weights streamed past L2) the
# one-row launch beats cuBLAS on every Llama-3.1-8B projection: qkv 14.1 vs 15.9 us, o 10.0 vs 12.9, gate_up 56.3 vs
# 58.4, down 29.7 vs 32.1, the LM head 234.5 vs 249.2; gate_up with SiLU-and-mul fused 56.5 vs 62.2 for F.linear +
# silu_and_mul. Batch-1 decode of the 8B shape (bench_e2e.py, one machine): the GEMV on every layer with the gated
# launch 242.9 tok/s (twice), and with the LM head too 243.9; without the gated launch 241.1; on qkv and o only
# 224.8. Without dependent launch it was never measured ahead of cuBLAS (an earlier launch lost 4.70 to 4.68 ms a
# step), so GPUs before Hopper and TRITONLLM_PDL=0 keep cuBLAS.
DENSE_GEMV_MAX_ROWS = 1
DENSE_GEMV_MAX_WEIGHT: int | None = None
GATED_GEMV_MAX_WEIGHT: int | None = None
DENSE_GEMV_DTYPES = (torch.float16, torch.bfloat16)  # what linear layers send to it (fp32 stays on F.linear)
MAX_TILE_NUMEL = 2**20  # Triton's largest tensor; the CUDA-core accumulator is BLOCK_M * BLOCK_N * BLOCK_K

# The heuristic's crossover to tl.dot on a GPU (explicit configs take either path up to 16 rows). On an H200
# (bench_gemv.py, M = 2 and 4) the CUDA-core launch ran at 0.48-0.71x cuBLAS's speed at 4 rows; the sweep's best
# launches there were mostly tl.dot tiles with 4 stages, and with the tl.dot default from two rows the 8B's
# projections run at 0.90-1.12x cuBLAS at 2-8 rows (gate_up with its activation fused: 1.03-1.05x). Parity is no
# reason to leave cuBLAS, so linear layers keep it past one row (DENSE_GEMV_MAX_ROWS).
CUDA_CORE_MAX_ROWS = 1
_INTERPRETER_CUDA_CORE_MAX_ROWS = 4
_PROGRAMS_PER_SM = 4  # CUDA-core path: split K below 2 programs per SM from the N tiles, up to this many
_MIN_TILES_PER_SPLIT = 2
_MAX_SPLIT_K = 16
_SMEM_PER_SM = 228 * 1024  # Hopper; the tl.dot path's stages decide how many of its programs an SM holds


@dataclass(slots=True, frozen=True)
class GemvConfig:
    block_n: int  # weight rows (output columns) per program
    block_k: int  # K elements per tile
    split_k: int  # programs along K (the last one to finish adds their fp32 partial sums)
    num_warps: int
    num_stages: int  # tl.dot: software-pipeline depth; CUDA cores: > 1 loads each weight tile one iteration ahead
    use_dot: bool


def block_m(m: int, use_dot: bool) -> int:
    """Rows one program computes: M padded to a power of two, or to the 16-row MMA tile on the tl.dot path."""
    return 16 if use_dot else triton.next_power_of_2(m)


def k_span(dtype: torch.dtype, num_warps: int) -> int:
    """K elements a CTA covers with one 16-byte load per thread: the CUDA-core path's smallest good BLOCK_K."""
    return 16 // dtype.itemsize * 32 * num_warps


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of the GPU (132 on an H200); 1 under the interpreter, which runs programs in turn."""
    if INTERPRET or not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_wanted(cfg: GemvConfig, itemsize: int, sms: int) -> int:
    """Programs the grid should reach: a few per SM on CUDA cores, one wave of resident tl.dot programs."""
    if not cfg.use_dot:
        return _PROGRAMS_PER_SM * sms
    smem = cfg.num_stages * (cfg.block_n + 16) * cfg.block_k * itemsize  # weight + x tile per stage
    return max(1, min(_SMEM_PER_SM // smem, 4)) * sms


def auto_split_k(cfg: GemvConfig, n: int, k: int, itemsize: int, sms: int) -> int:
    """Splits along K so the grid comes close to `programs_wanted` without passing it, each split at least two
    K tiles long; none when the N tiles alone reach half the programs wanted."""
    n_tiles = triton.cdiv(n, cfg.block_n)
    wanted = programs_wanted(cfg, itemsize, sms)
    if 2 * n_tiles >= wanted:
        return 1
    split = wanted // n_tiles  # rounded down: a last, partial wave would leave most SMs idle
    return max(1, min(split, triton.cdiv(k, cfg.block_k) // _MIN_TILES_PER_SPLIT, _MAX_SPLIT_K))


def _interpreter_config(m: int, n: int, k: int) -> GemvConfig:
    block_n = min(max(triton.next_power_of_2(n), 16), 64)
    block_k = min(max(triton.next_power_of_2(k), 16), 512)
    return GemvConfig(block_n, block_k, 1, 4, 1, use_dot=m > _INTERPRETER_CUDA_CORE_MAX_ROWS)  # one tl.dot per tile


@functools.lru_cache(maxsize=1024)  # called per launch: eager decode pays for every Python step
def gemv_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int, interpret: bool = INTERPRET) -> GemvConfig:
    """The launch for y[m, n] = x[m, k] @ W[n, k]^T at 1 <= m <= 16 rows on a GPU of `num_sms` SMs."""
    if interpret:
        return _interpreter_config(m, n, k)
    if m <= CUDA_CORE_MAX_ROWS:
        # 4 weight rows, 8 warps, one 16-byte load per thread and row per tile (4 KB of each weight row), no
        # prefetch: 32 fp32 accumulators per thread, so many programs per SM keep loads in flight. Swept on an
        # H200 with dependent launch (bench_gemv.py --sweep, M = 1): best on gate_up and down (55.9 and 29.2 us,
        # 99% and 95% of copy bandwidth; cuBLAS 63.2 and 32.3), where 8 rows with 4 warps and a prefetch took
        # 59.4 and 34.9.
        cfg = GemvConfig(4, k_span(dtype, 8), 1, 8, 1, use_dot=False)
    else:
        # 64 weight rows (one wgmma per warpgroup), 256 bytes of each per tile, 4 stages: 80 KB of shared memory
        # at 16 bits, two programs per SM.
        cfg = GemvConfig(64, 256 // dtype.itemsize, 1, 4, 4, use_dot=True)
    split = auto_split_k(cfg, n, k, dtype.itemsize, num_sms)
    return GemvConfig(cfg.block_n, cfg.block_k, split, cfg.num_warps, cfg.num_stages, cfg.use_dot)


def check_gemv_config(cfg: GemvConfig, m: int, gated: bool = False) -> None:
    """Refuse a launch the kernel cannot run (a wrong explicit config), naming the field to change."""
    if not isinstance(cfg, GemvConfig):
        raise ValueError(f"config must be a GemvConfig, got {type(cfg).__name__}")
    for name in ("block_n", "block_k", "num_warps"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v <= 0 or v & (v - 1):
            raise ValueError(f"config.{name} must be a positive power of two, got {v!r}")
    if cfg.num_warps > 16:
        raise ValueError(f"config.num_warps must be at most 16, got {cfg.num_warps}")
    for name in ("split_k", "num_stages"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"config.{name} must be an int >= 1, got {v!r}")
    if gated and cfg.block_n < 2:
        raise ValueError("a gated activation needs block_n >= 2 (each output's gate and up rows)")
    if cfg.use_dot and min(cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"tl.dot needs block_n and block_k >= 16, got {cfg.block_n} and {cfg.block_k}")
    bm = block_m(m, cfg.use_dot)
    if bm * cfg.block_n * cfg.block_k > MAX_TILE_NUMEL:
        raise ValueError(
            f"a {bm} x {cfg.block_n} x {cfg.block_k} tile exceeds Triton's {MAX_TILE_NUMEL} elements; "
            "lower block_n or block_k"
        )


def use_dense_gemv(
    rows: int,
    device: torch.device,
    dtype: torch.dtype,
    interpret: bool = INTERPRET,
    max_rows: int | None = None,
    *,
    weight_numel: int = 0,
) -> bool:
    """Whether a linear layer of `rows` input rows and a weight of `weight_numel` elements runs the GEMV kernel
    (else F.linear): compiled on a CUDA device with dependent launch on, fp16/bf16, 1..max_rows rows (default
    DENSE_GEMV_MAX_ROWS), a weight of at most DENSE_GEMV_MAX_WEIGHT elements. The interpreter runs it only in the
    kernel's tests."""
    return _use_gemv(rows, device, dtype, interpret, max_rows, weight_numel, DENSE_GEMV_MAX_WEIGHT)


def use_gated_gemv(
    rows: int,
    device: torch.device,
    dtype: torch.dtype,
    interpret: bool = INTERPRET,
    max_rows: int | None = None,
    *,
    weight_numel: int = 0,
) -> bool:
    """Whether a gated MLP's [gate; up] projection runs as one GEMV launch with its activation fused (else
    F.linear + the activation kernel): as `use_dense_gemv`, with GATED_GEMV_MAX_WEIGHT as the size limit."""
    return _use_gemv(rows, device, dtype, interpret, max_rows, weight_numel, GATED_GEMV_MAX_WEIGHT)


def _use_gemv(rows, device, dtype, interpret, max_rows, weight_numel, max_weight) -> bool:
    limit = DENSE_GEMV_MAX_ROWS if max_rows is None else max_rows
    if interpret or device.type != "cuda" or dtype not in DENSE_GEMV_DTYPES or not 1 <= rows <= limit:
        return False
    if max_weight is not None and weight_numel > max_weight:
        return False
    # Its edge over cuBLAS was measured with dependent launch (Hopper); other GPUs keep cuBLAS.
    return dependent_launch(device)["PDL"]
