"""Launch heuristics of the fused W4A16 GEMM (tritonllm/kernels/quant_gemm.py), all in one place.

Three paths, picked per call from M:
  * GEMV (`gemv=True`, decode): the packed weights streamed through CUDA-core FMAs, `block_m` activation rows per
    program where the paired fp16 kernel runs (fp16 activations and scales, 4-bit; quant_gemv_f16.py), else one.
    Bound by memory or by issuing instructions: what matters is enough programs in flight, hence split-K.
  * GEMM (neither flag): tl.dot over dequantized tiles, BLOCK_M >= 16 (the MMA height); small M splits K as
    well, larger M runs unsplit with wgmma-sized tiles; `swap_ab` computes y^T = W^T x^T (quant_gemm.py).
  * dequantize + matmul (`dequant=True`, from `DEQUANT_MIN_M` rows): a dense W^T written in [BLOCK_K, BLOCK_N]
    tiles, then cuBLAS (quant_dense.py); block_m, split_k and num_stages do not apply.

`quant_gemm_config` reads the Hopper table `HOPPER_TABLE` first (rows keyed by M bucket and N / K ranges, filled
from `python benchmarks/quant_gemm.py --sweep`, which times `sweep_candidates` on the GPU and prints rows in the
table's own syntax), then falls back to `generic_config`. Every decision reads Python ints only.
"""

import functools
from dataclasses import dataclass, replace

import torch
import triton

from tritonllm.platform import INTERPRET


@dataclass(slots=True, frozen=True)
class QuantGemmConfig:
    block_m: int  # rows per program (the fp32 GEMV kernel runs one whatever this says)
    block_n: int
    block_k: int  # K rows per tile (a multiple of 32 // bits: whole packed words)
    split_k: int  # programs along K (their fp32 partial sums are added by the last one to finish)
    num_warps: int
    num_stages: int  # GEMV kernel: > 1 loads each K tile one iteration ahead
    gemv: bool = False  # CUDA-core GEMV kernel instead of the tl.dot one
    dequant: bool = False  # dense W^T then a cuBLAS matmul (block_n, block_k, num_warps: the dequant tile)
    swap_ab: bool = False  # tl.dot kernel: y^T = W^T x^T, the dequantized tile as the MMA's A operand (registers)


@dataclass(slots=True, frozen=True)
class LaunchRule:
    """A row of the table: M, N and K each within an inclusive [low, high] range; `paired_only` rows apply only
    where the paired fp16 GEMV runs (measured with it; other operands fall through to the next matching row)."""

    m: tuple[int, int]
    n: tuple[int, int]
    k: tuple[int, int]
    config: QuantGemmConfig
    paired_only: bool = False

    def matches(self, m: int, n: int, k: int, paired: bool = False) -> bool:
        if self.paired_only and not paired:
            return False
        return self.m[0] <= m <= self.m[1] and self.n[0] <= n <= self.n[1] and self.k[0] <= k <= self.k[1]


# M buckets the table and the sweep use: decode (1), small batches, up to one 128-row MMA tile, then dequantize +
# matmul. Inclusive upper bounds.
M_BUCKETS: tuple[tuple[int, int], ...] = (
    (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 256), (257, 2**31 - 1)
)  # fmt: skip
# The fallback's GEMV limit: per weight the GEMV kernel issues about 5 instructions per row (sm_90 SASS), the
# 16-row tl.dot kernel about 8 for all its rows, so from two rows on the dot kernel does less work.
GEMV_MAX_M = 1
# The same for the paired fp16 GEMV (quant_gemv_f16.py), which reads the weights once for several rows: 13
# instructions per packed word to dequantize, ~13 per word and row for the dot (x's loads included). On the H200
# it beat the 16-row tl.dot kernel at 2 rows (1.1-1.3x on three of four projections) and lost from 3.
PAIRED_GEMV_MAX_M = 2
# Rows one program of the paired fp16 GEMV serves per pass over the weights: each row adds ~13 instructions per
# packed word (8 for the dot, the rest x's loads and re-pairing) and an fp32 accumulator per row and word held.
GEMV_MAX_BLOCK_M = 8
# The fallback's crossover to dequantize + matmul: past one 128-row MMA tile the fused tl.dot kernel runs at 25-45%
# of the dense matmul's rate, while dequantizing costs one write of W^T whatever M is. On the H200 dequantize +
# matmul won on all four Llama-3.1-8B projections from 160 rows on (1.5-2.8x at M = 192); vLLM's AWQ layer switches
# at 256 tokens.
DEQUANT_MIN_M = 129
# The dequantization tile: 64 K rows (within one group of 64 or more: one row of scales) by 256 columns.
DEQUANT_CONFIG = QuantGemmConfig(1, 256, 64, 1, 4, 1, dequant=True)

# Hopper (H200, 132 SMs) rows for fp16/bf16 at group size 128, Llama-3.1-8B's projections (qkv, o, gate_up, down);
# other shapes and M buckets fall back to the generic heuristics below (from 129 rows: dequantize + matmul, which on
# the H200 beat the best unswapped tl.dot launch at M = 256 on gate_up, 180 vs 257 us, and down, 102 vs 135 us, and
# ran within 0.84-0.95x of the dense matmul at M = 2048; the swapped kernel beats it on gate_up up to 256 rows).
# Measured with `python benchmarks/quant_gemm.py --sweep` on an H200 (triton 3.6, fp16); each comment gives the time
# and the speed-up over the cuBLAS fp16 matmul, both timed as CUDA graph replays over weight copies that exceed L2
# (docs/benchmarks.md).
HOPPER_TABLE: tuple[LaunchRule, ...] = (
    # M = 1, the paired fp16 GEMV: `quant_gemm.py --sweep --sweep-ms 1` (fp16, group 128), graph-timed; "fp32 GEMV"
    # is that kernel at its own rows below, in the same run.
    LaunchRule(
        m=(1, 1),
        n=(6144, 6144),
        k=(4096, 4096),
        config=QuantGemmConfig(1, 128, 128, 11, 4, 2, gemv=True),
        paired_only=True,
    ),  # M=1 qkv: 9.1 us (fp32 GEMV 14.4), dense / this 1.65
    LaunchRule(
        m=(1, 1),
        n=(4096, 4096),
        k=(4096, 4096),
        config=QuantGemmConfig(1, 128, 128, 16, 4, 2, gemv=True),
        paired_only=True,
    ),  # M=1 o: 7.7 us (fp32 GEMV 8.6), dense / this 1.65
    LaunchRule(
        m=(1, 1),
        n=(28672, 28672),
        k=(4096, 4096),
        config=QuantGemmConfig(1, 256, 64, 16, 4, 1, gemv=True),
        paired_only=True,
    ),  # M=1 gate_up: 28.1 us (fp32 GEMV 33.1), dense / this 2.08
    LaunchRule(
        m=(1, 1),
        n=(4096, 4096),
        k=(14336, 14336),
        config=QuantGemmConfig(1, 128, 128, 16, 4, 2, gemv=True),
        paired_only=True,
    ),  # M=1 down: 16.1 us (fp32 GEMV 19.4), dense / this 2.04
    # M = 2, the paired fp16 GEMV, two rows per program: `quant_gemm.py --sweep --sweep-ms 2,3` (fp16, group 128);
    # "tl.dot" is the 16-row kernel's best launch in the same sweep. At 3 rows tl.dot won on every projection, and
    # at 2 on o (10.1 against 10.0 us for a one-row GEMV: a tie), so those keep the rows further down.
    LaunchRule(
        m=(2, 2),
        n=(6144, 6144),
        k=(4096, 4096),
        config=QuantGemmConfig(2, 256, 64, 16, 4, 2, gemv=True),
        paired_only=True,
    ),  # M=2 qkv: 10.9 us (tl.dot 13.8), dense / this 1.49
    LaunchRule(
        m=(2, 2),
        n=(28672, 28672),
        k=(4096, 4096),
        config=QuantGemmConfig(2, 128, 128, 3, 4, 1, gemv=True),
        paired_only=True,
    ),  # M=2 gate_up: 40.4 us (tl.dot 47.7), dense / this 1.44
    LaunchRule(
        m=(2, 2),
        n=(4096, 4096),
        k=(14336, 14336),
        config=QuantGemmConfig(2, 128, 64, 32, 4, 2, gemv=True),
        paired_only=True,
    ),  # M=2 down: 24.6 us (tl.dot 27.6), dense / this 1.41
    # M = 1, the fp32 GEMV (bf16 activations, or operands the paired GEMV does not take): `quant_gemm.py --sweep
    # --sweep-ms 1`, timed as CUDA graph replays (fp16, group 128, before the paired GEMV).
    LaunchRule(
        m=(1, 1), n=(6144, 6144), k=(4096, 4096), config=QuantGemmConfig(1, 64, 128, 4, 4, 2, gemv=True)
    ),  # M=1 qkv: 10.8 us (before 11.1), dense / this 1.53
    LaunchRule(
        m=(1, 1), n=(4096, 4096), k=(4096, 4096), config=QuantGemmConfig(1, 64, 128, 9, 4, 2, gemv=True)
    ),  # M=1 o: 8.7 us (before 9.7), dense / this 1.50
    LaunchRule(
        m=(1, 1), n=(28672, 28672), k=(4096, 4096), config=QuantGemmConfig(1, 256, 64, 8, 4, 1, gemv=True)
    ),  # M=1 gate_up: 33.8 us (before 35.4), dense / this 1.75
    LaunchRule(
        m=(1, 1), n=(4096, 4096), k=(14336, 14336), config=QuantGemmConfig(1, 128, 128, 17, 4, 1, gemv=True)
    ),  # M=1 down: 20.0 us (before 21.3), dense / this 1.70
    # 2-128 rows: `quant_gemm.py --sweep --sweep-ms 4,16,32,64,128`, graph-timed (fp16, group 128). The 4- and
    # 16-row sweeps picked the same launches, hence one row for both buckets.
    LaunchRule(
        m=(2, 16), n=(6144, 6144), k=(4096, 4096), config=QuantGemmConfig(16, 64, 128, 4, 4, 3)
    ),  # M=4 / 16 qkv: 13.9 / 14.3 us, dense / this 1.17 / 1.12
    LaunchRule(
        m=(2, 16), n=(4096, 4096), k=(4096, 4096), config=QuantGemmConfig(16, 64, 128, 9, 4, 3)
    ),  # M=4 / 16 o: 10.9 / 11.3 us, dense / this 1.20 / 1.17
    LaunchRule(
        m=(2, 16), n=(28672, 28672), k=(4096, 4096), config=QuantGemmConfig(16, 64, 128, 2, 4, 3)
    ),  # M=4 / 16 gate_up: 48.9 / 50.2 us, dense / this 1.28 / 1.19
    LaunchRule(
        m=(2, 16), n=(4096, 4096), k=(14336, 14336), config=QuantGemmConfig(16, 64, 128, 8, 4, 3)
    ),  # M=4 / 16 down: 26.8 / 27.0 us, dense / this 1.30 / 1.18
    LaunchRule(
        m=(17, 32), n=(6144, 6144), k=(4096, 4096), config=QuantGemmConfig(32, 64, 128, 4, 4, 3)
    ),  # M=32 qkv: 18.0 us, dense / this 0.92
    LaunchRule(
        m=(17, 32), n=(4096, 4096), k=(4096, 4096), config=QuantGemmConfig(32, 64, 128, 4, 4, 3)
    ),  # M=32 o: 14.0 us, dense / this 0.93
    LaunchRule(
        m=(17, 32), n=(28672, 28672), k=(4096, 4096), config=QuantGemmConfig(32, 256, 64, 2, 4, 3)
    ),  # M=32 gate_up: 58.7 us, dense / this 1.04
    LaunchRule(
        m=(17, 32), n=(4096, 4096), k=(14336, 14336), config=QuantGemmConfig(32, 128, 128, 8, 4, 3)
    ),  # M=32 down: 33.0 us, dense / this 1.00
    LaunchRule(
        m=(33, 64), n=(6144, 6144), k=(4096, 4096), config=QuantGemmConfig(64, 64, 128, 4, 4, 3, swap_ab=True)
    ),  # M=64 qkv: 18.9 us (unswapped 23.3), dense / this 0.88
    LaunchRule(
        m=(33, 64), n=(4096, 4096), k=(4096, 4096), config=QuantGemmConfig(64, 64, 128, 4, 8, 3)
    ),  # M=64 o: 16.4 us, dense / this 0.72
    LaunchRule(
        m=(33, 64), n=(28672, 28672), k=(4096, 4096), config=QuantGemmConfig(64, 128, 128, 1, 8, 3, swap_ab=True)
    ),  # M=64 gate_up: 65.4 us (unswapped 73.4), dense / this 0.91
    LaunchRule(
        m=(33, 64), n=(4096, 4096), k=(14336, 14336), config=QuantGemmConfig(64, 64, 128, 4, 8, 3)
    ),  # M=64 down: 42.8 us, dense / this 0.83
    LaunchRule(
        m=(65, 128), n=(6144, 6144), k=(4096, 4096), config=QuantGemmConfig(128, 64, 64, 4, 4, 3, swap_ab=True)
    ),  # M=128 qkv: 28.6 us (unswapped 32.8, dequantize + matmul 34.7), dense / this 0.60
    LaunchRule(
        m=(65, 128), n=(4096, 4096), k=(4096, 4096), config=QuantGemmConfig(128, 64, 128, 2, 8, 3)
    ),  # M=128 o: 22.1 us (dequantize + matmul 25.9), dense / this 0.63
    LaunchRule(
        m=(65, 128), n=(28672, 28672), k=(4096, 4096), config=QuantGemmConfig(128, 128, 64, 1, 4, 3, swap_ab=True)
    ),  # M=96 / 128 gate_up: 95.2 / 95.4 us (unswapped 100.5 / 114.9), dense / this 0.65 / 1.10
    LaunchRule(
        m=(65, 128), n=(4096, 4096), k=(14336, 14336), config=QuantGemmConfig(128, 64, 128, 4, 4, 3, swap_ab=True)
    ),  # M=128 down: 51.9 us (unswapped 61.5), dense / this 0.71
    # 129-256 rows, gate_up only (the others keep dequantize + matmul): the swapped tl.dot kernel's 256-row tile.
    LaunchRule(
        m=(129, 256), n=(28672, 28672), k=(4096, 4096), config=QuantGemmConfig(256, 128, 64, 1, 8, 3, swap_ab=True)
    ),  # M=160 / 192 / 256 gate_up: 145.8 / 145.7 / 146.1 us (dequantize + matmul 146.8 / 153.1 / 172.8)
)

# Split-K: programs the grid should reach per SM, and K tiles each split walks at least. Up to 16 rows the launch
# is bound by reading the weights and wants several programs per SM in flight; beyond, every split adds an fp32
# [M, N] partial round trip that grows with M, so splitting only fills the SMs once.
_PROGRAMS_PER_SM_SMALL_M = 4
_PROGRAMS_PER_SM = 1
_MIN_TILES_PER_SPLIT = 2
_MAX_SPLIT_K = 64


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of the GPU; a small stand-in under the interpreter, which runs programs in turn."""
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def auto_split_k(m: int, m_tiles: int, n_tiles: int, k: int, block_k: int, sms: int) -> int:
    """Splits along K so the grid reaches the programs per SM wanted for M rows, each split >= 2 K tiles."""
    per_sm = _PROGRAMS_PER_SM_SMALL_M if m <= 16 else _PROGRAMS_PER_SM
    k_tiles = triton.cdiv(k, block_k)
    wanted = triton.cdiv(per_sm * sms, m_tiles * n_tiles)
    return max(1, min(wanted, k_tiles // _MIN_TILES_PER_SPLIT, _MAX_SPLIT_K))


def generic_config(m: int, n: int, k: int, sms: int, paired: bool = False) -> QuantGemmConfig:
    """The fallback: GEMV for a few rows (all of them in one pass over the weights where the paired fp16 GEMV
    runs), a 16-row MMA tile up to 16, 32- and 64-row tiles (split K to fill the GPU) up to one 128-row stretch,
    dequantize + matmul from `DEQUANT_MIN_M` rows."""
    if m >= DEQUANT_MIN_M:
        return DEQUANT_CONFIG
    if m <= (PAIRED_GEMV_MAX_M if paired else GEMV_MAX_M):
        block_m, block_n, block_k, warps, stages, gemv = triton.next_power_of_2(m), 128, 128, 4, 2, True
    elif m <= 16:
        block_m, block_n, block_k, warps, stages, gemv = 16, 64, 128, 4, 3, False
    elif m <= 32:
        block_m, block_n, block_k, warps, stages, gemv = 32, 128, 64, 4, 3, False
    else:  # up to DEQUANT_MIN_M - 1 rows; 64-row tiles take 8 warps (two warpgroups): 4 spill at BLOCK_N 128
        block_m, block_n, block_k, warps, stages, gemv = 64, 128, 64, 8, 3, False
    split = auto_split_k(m, triton.cdiv(m, block_m), triton.cdiv(n, block_n), k, block_k, sms)
    return QuantGemmConfig(block_m, block_n, block_k, split, warps, stages, gemv)


def check_config(cfg: QuantGemmConfig, bits: int) -> None:
    """Refuse a config the kernels cannot run (a wrong explicit config, or a bad table row)."""
    pack = 32 // bits
    sizes = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(s <= 0 or s & (s - 1) for s in sizes):
        raise ValueError(f"block sizes must be powers of two, got {sizes}")
    if cfg.block_k % pack:
        raise ValueError(f"block_k {cfg.block_k} must hold whole words of {pack} {bits}-bit values")
    if cfg.gemv and cfg.dequant:
        raise ValueError("a config is either the GEMV kernel (gemv) or dequantize + matmul (dequant), not both")
    if cfg.swap_ab and (cfg.gemv or cfg.dequant):
        raise ValueError("swap_ab applies to the tl.dot kernel only, not to the GEMV or dequantize + matmul")
    if cfg.gemv and cfg.block_m > GEMV_MAX_BLOCK_M:
        raise ValueError(f"the GEMV kernels take block_m <= {GEMV_MAX_BLOCK_M} rows per program, got {cfg.block_m}")
    if cfg.dequant and cfg.split_k != 1:
        raise ValueError(f"dequantize + matmul does not split K, got split_k {cfg.split_k}")
    if not cfg.gemv and not cfg.dequant and min(sizes) < 16:
        raise ValueError(f"tl.dot needs block_m, block_n, block_k >= 16, got {sizes}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {cfg.split_k}")


def quant_gemm_config(
    m: int, n: int, k: int, bits: int = 4, sms: int | None = None, paired: bool = False
) -> QuantGemmConfig:
    """The launch for y[m, n] = x[m, k] @ W (`sms`: the GPU's SM count, default the current one's; `paired`:
    whether the paired fp16 GEMV takes the operands, quant_gemv_f16.paired_gemv_applies)."""
    sms = sms or num_sms()
    pack = 32 // bits
    rule = None if INTERPRET else next((r for r in HOPPER_TABLE if r.matches(m, n, k, paired)), None)
    cfg = rule.config if rule is not None else generic_config(m, n, k, sms, paired)
    if cfg.block_k < pack:  # 2-bit words hold 16 rows
        cfg = replace(cfg, block_k=pack)
    return cfg


def sweep_candidates(m: int, paired: bool = False) -> list[QuantGemmConfig]:
    """Launch configs worth timing for M rows on Hopper (split_k 0: `sweep_splits` supplies the splits; dequantize +
    matmul configs come with split_k 1). `paired`: the operands the paired fp16 GEMV takes, which also runs
    several rows per program."""
    out: list[QuantGemmConfig] = []
    if m <= (GEMV_MAX_BLOCK_M if paired else 8):
        rows = [1 << i for i in range(triton.next_power_of_2(m).bit_length())] if paired else [1]
        for block_m in rows:
            for block_n in (64, 128, 256):
                for block_k in (64, 128, 256):
                    for warps in (4, 8):
                        for stages in (1, 2):  # GEMV: 2 loads each tile one iteration ahead
                            # < 32 words per thread (more spills registers), fewer with more rows
                            if block_n * block_k * max(1, block_m // 2) < 8192 * warps:
                                out.append(QuantGemmConfig(block_m, block_n, block_k, 0, warps, stages, gemv=True))
    if m <= 16:
        for block_n in (32, 64, 128):
            for block_k in (64, 128, 256):
                for stages in (2, 3):
                    if block_n * block_k <= 8192:  # larger tiles spill registers on sm_90
                        out.append(QuantGemmConfig(16, block_n, block_k, 0, 4, stages))
        return out
    for block_m in (16, 32, 64) if m <= 64 else (64, 128, 256):
        for block_n in (64, 128, 256):
            for block_k in (32, 64, 128):
                warps = 8 if block_m >= 64 else 4  # 64-row tiles: two warpgroups; larger tiles spill on sm_90
                launches = [(False, warps), (True, warps)]
                if block_m >= 64:  # swapped, the weight tile is the MMA's M side: one warpgroup can hold it
                    launches.append((True, 4))
                for swap_ab, w in launches:
                    if block_n * block_k <= 16384 and block_m * block_n <= 4096 * w and block_m * block_k <= 16384:
                        out.append(QuantGemmConfig(block_m, block_n, block_k, 0, w, 3, swap_ab=swap_ab))
    if m >= 64:  # dequantize + matmul: the dequantization tile (split_k is always 1)
        for block_n in (128, 256, 512):
            for block_k in (32, 64, 128):
                for warps in (4, 8):
                    out.append(QuantGemmConfig(1, block_n, block_k, 1, warps, 1, dequant=True))
    return out


def sweep_splits(m: int, m_tiles: int, n_tiles: int, k: int, block_k: int, sms: int) -> list[int]:
    """split_k values to try for one tile config: 1, the automatic choice, and powers of two up to the K tiles."""
    k_tiles = triton.cdiv(k, block_k)
    auto = auto_split_k(m, m_tiles, n_tiles, k, block_k, sms)
    return sorted({1, auto, *(s for s in (2, 4, 8, 16, 32) if s <= k_tiles)})
