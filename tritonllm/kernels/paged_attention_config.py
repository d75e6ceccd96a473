"""Launch heuristics of paged attention (tritonllm/kernels/paged_attention.py), all in one place.

Two targets with opposite cost models:
- a GPU (tuned for Hopper): the kernel is bound by reading K/V, so a launch needs enough programs in flight
  to saturate DRAM; decode at small batch splits each sequence's KV range over several programs (split-KV).
- Triton's CPU interpreter: programs run one after another and every Triton op costs a fixed Python overhead
  whatever its tile size, so the fastest launch is the fewest programs with the fewest loop iterations: one
  program per query tile covering every KV head, KV tiles as long as the sequences.

Every decision reads Python ints only (shapes, max_query_len, max_seq_len, the SM count), never tensor
contents: a CUDA graph captured with max_seq_len = max_model_len replays correctly for shorter sequences.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton

from tritonllm.platform import INTERPRET


@dataclass(slots=True, frozen=True)
class AttentionTarget:
    """What a launch is planned for."""

    interpret: bool  # Triton's interpreter: cost per op per program, not per element
    num_sms: int  # streaming multiprocessors (1 under the interpreter: programs run in turn)
    dram_gbs: float = 4800.0  # peak DRAM bandwidth: the K/V reads a decode grid must keep in flight scale with it


HOPPER_H200 = AttentionTarget(interpret=False, num_sms=132, dram_gbs=4800.0)
HOPPER_H100 = AttentionTarget(interpret=False, num_sms=132, dram_gbs=3352.3)  # H100 SXM5 80GB HBM3


@functools.lru_cache(maxsize=8)
def current_target(device_index: int = 0) -> AttentionTarget:
    if INTERPRET or not torch.cuda.is_available():
        return AttentionTarget(interpret=True, num_sms=1)
    props = torch.cuda.get_device_properties(device_index)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    dram_gbs = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate; 0 where torch does not report them
    return AttentionTarget(interpret=False, num_sms=props.multi_processor_count, dram_gbs=dram_gbs or 4800.0)


@dataclass(slots=True, frozen=True)
class PagedAttentionConfig:
    block_m: int  # rows per program: block_q query tokens x kv_heads_per_program x the GQA group (power of two)
    block_q: int  # query tokens per program
    tile_n: int  # KV positions per loop iteration (power of two)
    kv_heads_per_program: int  # 1, or all KV heads (interpreter): heads packed block-diagonally along D
    num_warps: int
    num_stages: int
    num_splits: int = 1  # > 1: split-KV, each sequence's KV range over this many programs, then a merge
    merge_heads_per_program: int = 1  # query heads per program of the split-KV merge launch (power of two)
    merge_in_launch: bool = True  # split-KV: the last split program of a tile merges; False: a merge launch
    merge_chunk: int = 4  # splits the in-launch merge reads per step ([block_m, chunk, D] fp32; power of two)
    # Split-KV: each used split walks at least this many KV tiles of its sequence, so a sequence shorter than
    # num_splits x split_min_tiles tiles uses fewer splits (decided on the device from its length: a graph planned
    # for max_model_len gives a short sequence fewer, fuller splits and its merge fewer partials to read). 1: at
    # batch 1-2 more, shorter splits measured faster on an H100 (docs/benchmarks.md, seventeenth pass).
    split_min_tiles: int = 1
    # Sequences of at most short_queries.block_q queries (the decodes of a mixed step) run in a launch of their
    # own with this decode-shaped config, one program per sequence; this config's launch skips them. Without it
    # a decode next to a prefill chunk gets a whole prefill tile (128 rows) for its one token's GQA group.
    short_queries: "PagedAttentionConfig | None" = None


@dataclass(slots=True, frozen=True)
class _Tile:
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 3  # resident decode programs per SM (registers, shared memory): what a wave holds
    read_latency_us: float = 0.95  # what its programs' K/V reads in flight must cover (`_feed`; fitted, see below)


# Hopper (sm_90) table for fp16/bf16, keyed by (padded head size, "decode" | "decode_full_grid" | "decode_crowded" |
# "prefill"; the second and third are described below). "decode" is a query tile of at most _DECODE_ROWS rows
# (decode, speculative decode, short chunks); its block_m is only an upper bound, the tile shrinks to the rows
# needed (>= 16, the MMA height).
# Where the numbers come from: FlashAttention-style Triton kernels on H100 for prefill (wgmma tiles of 64-128
# rows, 3 stages: two K/V buffers in flight); for decode (mma.sync, 16 rows), the Triton 3.9 pipeliner keeps
# num_stages - 3 K/V tiles in flight behind the block-table load (stages 5: two tiles, 70 KiB of shared memory
# at D = 128), checked by compiling every entry for sm_90 offline (ptxas: no spills).
# Head size 128 was swept on an H200 (`python benchmarks/bench_attention.py --sweep`, triton 3.6): for prefill the
# 128 x 32 tile with 4 warps was best at every length (1.13-1.25x the earlier 128 x 64 / 8 warps); for decode the
# entry below is within 5% of each shape's best (the best single tile, 32 x 6 stages, is within 2%, too close to
# change the split heuristics it feeds). Head size 64 was swept the same way (32 / 8 heads; decode at batch 1, 8,
# 64 and 8k / 4k / 8k contexts, prefill at 512 and 2048): the decode entry is within 1% of the best single tile
# (1.04 against 1.03 of each shape's best); for prefill 128 x 64 with 8 warps and 2 stages is within 1% of each
# length's best, 7-10% faster than the 4-warp, 3-stage tile before. Head size 256 (16 / 8 heads): the decode entry
# was the best tile at batch 64, 8k and its 6-stage variant at batch 8, 4k (tiles of 128 keys do not fit in shared
# memory); at batch 1, 8k it takes 34.8 us against 28.5 for tile_n 64 with 8 warps, kept for the larger batches
# one graph tile serves. Prefill: 128 x 64, 8 warps, 4 stages was best at 2048 and 512 tokens (0.326 ms at 512
# against 0.391 for the 64 x 32, 4-warp tile before).
# "decode_full_grid": a second decode tile for grids of at least one program per SM, narrower so that more programs
# are resident per SM: a part-empty last wave of resident programs costs most. Measured on an H200 (32 / 8 heads,
# 1k / 4k contexts, % of copy bandwidth): batch 64 (512 programs: one wave of the 32-key tile, 1.3 of the 64-key one)
# 93.0 / 103.5 against 74.9 / 83.6 and 76.6 / 98.8 for two 64-key splits; batch 96 (768: 1.45 waves of the 32-key
# tile, 1.94 of the 64-key one) 80.8 / 86.5 against 93.5 / 103.5; batch 32 (less than a wave of either) 76.4 / 89.6
# against 85.3 / 100.9 (within 1% of each other on an H100).
# "decode_crowded": a third, 16 keys and 2 warps: a quarter of the wide tile's registers, so 8 programs are resident
# per SM, and a grid of up to that many spreads over the SMs within one program of each other, with no part-empty
# second wave. Which tile a grid of at least one program per SM gets (`_full_grid_tile`): first, a tile must keep
# enough K/V reads in flight on every SM to cover the DRAM latency at the GPU's bandwidth per SM (Little's law;
# `_feed`), so the narrower a tile, the more programs per SM it needs, and the more so on a faster GPU; among those,
# the one whose last wave is fullest (a grid within one wave counts as full), ties to the most resident programs.
# Each tile's read latency (`_Tile.read_latency_us`) is fitted where it starts to win: how many of its K/V reads a
# program keeps in flight differs from tile to tile, and the latency absorbs that. % of copy bandwidth at 1k / 4k
# (docs/benchmarks.md, twenty-second and twenty-fourth passes). 32 keys: H100 (3.35 TB/s, 132 SMs) lost at 1.58
# programs per SM (batch 26: 79.3 / 91.6 against 79.3 / 93.3 for 64 keys) and won at 1.70 (batch 28: 82.2 / 93.0
# against 79.1 / 91.4), so 1.02-1.09 us; H200 (4.8 TB/s) lost 9-11 points at 1.94 (batch 32) and tied at 2.42
# (batch 40), so about 1.09 us. 16 keys: H100 lost at 2.97 (batch 49: 87.4 / 95.0 against 90.0 / 98.5 for 32
# keys) and won at 3.03 (batch 50: 88.1 / 94.8 against 86.4 / 92.8), so 0.96-0.98 us; H200 trailed 32 keys by 1-2.5
# points at 3.88 (batch 64) and won at 4.36 (batch 72: 85.5 / 92.3 against 80.7 / 87.8 for 64 keys), so 0.87-0.98
# us. The switches: 32 keys from batch 27 (H100) and 39 (H200), 16 keys from batch 50 and 72 (8 KV heads).
# The other tiles keep 0.95 us, which matters only to grids of fewer programs than SMs (`_unsplit_busy`): there
# one 64-key program feeds all of an H100's SM and 0.95 of an H200's, so on the H200 batch 13 splits, 14 does not.
# Triton 3.6, head 128 (registers a thread, shared memory, resident programs): 64 keys 142, 70 KiB, 3; 32 keys 106,
# 37 KiB, 4; 16 keys 122 (2 warps), 21 KiB, 8. H100, 1k / 4k, % of copy bandwidth (docs/benchmarks.md, seventeenth
# pass), the tile now chosen against the best other: batch 40 (320 programs) 32 keys 87.6-89.5 / 99.4-99.8 against
# 82.0-84.9 / 93.9-95.0; batch 56 16 keys 90.7-93.1 / 97.2-100.2 against 87.5-90.4 / 93.8-97.7; batch 80 16 keys
# 96.7-96.9 / 101.9-102.0 against 89.5-90.1 / 94.6-95.3; batch 192 (1.45 waves of the 16-key tile) 32 keys 98.4 /
# 101.9 against 97.4 / 100.4.
_DECODE_ROWS = 32
_HOPPER_16BIT: dict[tuple[int, str], _Tile] = {
    (64, "decode"): _Tile(block_m=32, tile_n=128, num_warps=4, num_stages=5),
    (128, "decode"): _Tile(block_m=32, tile_n=64, num_warps=4, num_stages=5),
    (128, "decode_full_grid"): _Tile(
        block_m=32, tile_n=32, num_warps=4, num_stages=5, programs_per_sm=4, read_latency_us=1.05
    ),
    (128, "decode_crowded"): _Tile(
        block_m=32, tile_n=16, num_warps=2, num_stages=5, programs_per_sm=8, read_latency_us=0.97
    ),
    (256, "decode"): _Tile(block_m=32, tile_n=32, num_warps=4, num_stages=5),
    (64, "prefill"): _Tile(block_m=128, tile_n=64, num_warps=8, num_stages=2),
    (128, "prefill"): _Tile(block_m=128, tile_n=32, num_warps=4, num_stages=3),
    (256, "prefill"): _Tile(block_m=128, tile_n=64, num_warps=8, num_stages=4),
}
# fp32 runs true-fp32 dots on FMA units (no tensor cores, operands in registers): narrow KV tiles and 8 warps
# keep every entry free of register spills; it is the exactness path, not a fast one.
_HOPPER_FP32: dict[tuple[int, str], _Tile] = {
    (64, "decode"): _Tile(block_m=32, tile_n=32, num_warps=8, num_stages=2),
    (128, "decode"): _Tile(block_m=32, tile_n=32, num_warps=8, num_stages=2),
    (256, "decode"): _Tile(block_m=32, tile_n=16, num_warps=8, num_stages=2),
    (64, "prefill"): _Tile(block_m=64, tile_n=32, num_warps=8, num_stages=2),
    (128, "prefill"): _Tile(block_m=64, tile_n=16, num_warps=8, num_stages=2),
    (256, "prefill"): _Tile(block_m=32, tile_n=16, num_warps=8, num_stages=2),
}

# Split-KV: programs the grid should reach per SM, and KV tiles each split walks at least.
_SPLIT_PROGRAMS_PER_SM = 2
_SPLIT_MIN_TILES = 1
_MAX_SPLITS = 64
# A grid of more than one wave of resident programs but fewer than about two finishes its last, part-empty wave
# at a fraction of the bandwidth: on the H200 (`bench_attention.py --split-sweep`, head 128, context 4k-8k), 512
# decode programs (1.3 waves) ran at 78-84% of copy bandwidth where 768-3072 ran at 92-103%. Such grids split
# until they pass _MIN_WAVES waves of their tile's resident programs (_Tile.programs_per_sm).
_MIN_WAVES = 1.9
# A decode grid split at most this many ways picks its tile by the rule of grids that need no split
# (`_full_grid_tile`, on the split grid's program count). H100, per layer inside a step's graph, % of copy
# bandwidth at 4k / 16k: batch 8 split 4 ways on the 32-key tile 83.9 / 95.1 against 77.0 / 88.9 for 5 ways on
# the 64-key one (the plan before); batch 4, 8 ways, 75.4 / 91.2 against 72.2 / 90.4. Batch 1-3 (16 ways, below)
# keep the tile they were tuned with.
_SPLIT_GRID_MAX_SPLITS = 8
# A grid of fewer programs than SMs splits only while unsplit it would draw less than this share of the DRAM
# bandwidth (`_unsplit_busy`): splitting adds a fixed cost (partials, their merge) and gives back only the idle
# SMs' share. H100, head 128, per layer inside a step's graph (`bench_attention.py --chain --chain-match
# "1 split"`), us at 1k / 4k / 16k, unsplit against 3 splits (the plan before): batch 12 (96 programs, 0.73 of the
# SMs) 24.1 / 82.9 / 314.9 against 28.9 / 81.8 / 294.9; batch 13 (0.79) 24.4 / 84.1 / 318.4 against 29.8 / 85.5 /
# 311.0; batch 16 (0.97) 27.6 / 97.7 / 368.3 against 33.6 / 100.9 / 373.0; batch 11 (0.67) 23.7 / 82.6 / 313.1
# against 23.1 / 70.0 / 253.9. Batch 13 at 16k is the loss (5% in a second run); serving contexts mostly fall short
# of the max_model_len a decode graph is planned for, where unsplit wins.
_SPLIT_BELOW_BUSY = 0.75
# A decode grid so small that _FEW_PROGRAMS_SPLITS splits of it fit in one wave of resident programs (batch 1-3 at
# 8 KV heads on 132 SMs) is bound by each program's chain of dependent round trips (block table, K/V, partials),
# not by how evenly its programs fill the SMs: it splits _FEW_PROGRAMS_SPLITS ways and merges in a launch of its
# own, whose programs read the partials in parallel. H100, head 128, per layer inside a step's graph
# (`bench_attention.py --chain --chain-match "splits, "`), 1k / 4k / 16k, us: batch 1 8.41 / 14.52 / 33.21 (32
# splits merged in the launch, the plan before) -> 7.21 / 13.63 / 30.36 (SDPA 7.25 / 13.14 / 30.66); batch 2 10.51 /
# 19.57 / 54.67 (16 in the launch) -> 9.22 / 18.45 / 53.21; batch 3 12.13 / 26.22 / 79.77 (8 in the launch) -> 10.94
# / 25.90 / 78.22. Batch 4 (512 programs at 16 splits, more than a wave) lost 10-16% with it.
_FEW_PROGRAMS_SPLITS = 16
# The last split program of a tile merges in the launch up to this many splits, reading the partials a chunk of
# splits at a time ([block_m, chunk, D] fp32 in _MERGE_REGISTERS registers a thread: 8 splits at 16 rows x 128);
# more splits go to a merge launch, whose programs read them all in parallel. More splits than a whole number of
# chunks round down to one (33 -> 32): the extra split costs a whole merge step. H200, head 128, batch 1-8,
# per layer inside a step's graph (`bench_attention.py --chain`): 8-split chunks in the launch beat 4-split
# chunks by 3-25% and the merge launch at 8-32 splits by up to 9% (batch 1 at 1k-32k: 32 splits 9.3-41.2 us
# against 10.2-42.4); at 64 splits the merge launch wins. (On an H100, with programmatic dependent launch, the
# merge launch won at batch 1-3: _FEW_PROGRAMS_SPLITS above.) The wide chunk costs the kernel its third resident
# program per SM (Triton 3.6, sm_90: 192 registers a thread instead of 167), so a grid of more than
# _SPLIT_PROGRAMS_PER_SM programs per SM merges with half of it (batch 8, 5 splits = 320 programs: 45 -> 59 us at
# 4k with the wide one).
_MERGE_IN_LAUNCH_MAX_SPLITS = 32
_MERGE_REGISTERS = 128
_MERGE_REGISTERS_FULL_GRID = 64

# Interpreter: tiles are nearly free there (numpy), ops and programs are not. Triton caps a tile at 2^20
# elements, so rows x KV positions, rows x columns and KV positions x columns each stay within 1024 x 1024.
_INTERP_MAX_ROWS = 1024
_INTERP_MAX_TILE_N = 1024
_INTERP_MAX_COLS = 1024  # kv heads x padded head size packed into one program


def choose_num_splits(
    num_programs: int,
    num_sms: int,
    max_seq_len: int,
    tile_n: int,
    merge_chunk: int,
    programs_per_sm: int = 3,
    unsplit_busy: float = 0.0,
) -> int:
    """KV splits per sequence for a launch of `num_programs` = num_seqs * num_kv_heads unsplit programs.

    A grid small enough that _FEW_PROGRAMS_SPLITS splits of it fit in one wave of resident programs
    (`programs_per_sm` per SM) takes that many; its merge is a launch of its own (see above). Otherwise split while
    the grid is short of a program per SM and draws less than _SPLIT_BELOW_BUSY of the DRAM bandwidth unsplit
    (`unsplit_busy`), up to _SPLIT_PROGRAMS_PER_SM programs per SM (to the split count on either side of that whose
    programs spread most evenly over the SMs, the smaller on ties), or when it is between one and _MIN_WAVES waves
    of resident programs (see above), past `merge_chunk` splits only in whole chunks; never into splits shorter
    than _SPLIT_MIN_TILES KV tiles of the longest sequence. A sequence shorter than max_seq_len cuts its own range
    into the same number of splits, leaving any beyond its tiles empty (a launch slot, not a read): what a CUDA
    graph captured at max_model_len replays.
    """
    if num_programs <= 0:
        return 1
    resident = programs_per_sm * num_sms
    few = _few_programs(num_programs, num_sms, programs_per_sm)
    if few:
        wanted = _FEW_PROGRAMS_SPLITS
    elif num_programs < num_sms:
        if unsplit_busy >= _SPLIT_BELOW_BUSY:
            return 1  # the SMs it leaves idle give back less than the partials and their merge cost
        # The SM with the most programs finishes last: 64 programs split 4 ways (1.94 per SM) beat 5 ways (2.4).
        # On ties, fewer splits, so fewer partials to write and merge: 96 programs split 2 ways took 25.4 / 145.0 us
        # at 1k / 8k on an H100 against 28.2 / 152.7 for 3 (docs/benchmarks.md, nineteenth pass).
        target = _SPLIT_PROGRAMS_PER_SM * num_sms
        candidates = {max(1, target // num_programs), triton.cdiv(target, num_programs)}
        wanted = max(sorted(candidates), key=lambda n: _per_sm_fill(num_programs * n, num_sms))
    elif resident < num_programs < _MIN_WAVES * resident:
        wanted = math.ceil(_MIN_WAVES * resident / num_programs)
    else:
        return 1
    splits = max(1, min(wanted, max_seq_len // (tile_n * _SPLIT_MIN_TILES), _MAX_SPLITS))
    if splits > merge_chunk and not few:  # a merge launch reads every split at once: no chunks to round to
        splits -= splits % merge_chunk
    return splits


def _few_programs(num_programs: int, num_sms: int, programs_per_sm: int) -> bool:
    """Whether a decode grid is small enough that _FEW_PROGRAMS_SPLITS splits of it fit in one wave."""
    return num_programs * _FEW_PROGRAMS_SPLITS <= programs_per_sm * num_sms


def _per_sm_fill(programs: int, num_sms: int) -> float:
    """Programs per SM over the most any SM gets: 1.0 when they spread evenly."""
    return programs / (triton.cdiv(programs, num_sms) * num_sms)


def paged_attention_config(
    *,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    target: AttentionTarget | None = None,
) -> PagedAttentionConfig:
    """Every launch decision of paged attention (`target`: default the current device or the interpreter).

    num_splits: None chooses (split-KV only where it pays: a GPU grid too small for its SMs); an explicit value
    is honoured where split-KV applies, which is when every sequence's queries fit in one query tile
    (decode, speculative decode, short chunks); a batch with a longer prefill always runs unsplit.
    """
    target = target or current_target()
    queries_per_kv = num_heads // num_kv_heads
    head_padded = triton.next_power_of_2(head_size)
    max_query_len = max(1, max_query_len)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be None or >= 1, got {num_splits}")
    if target.interpret:
        shape = (num_kv_heads, queries_per_kv, head_padded, max_query_len, max_seq_len, sliding_window)
        cfg = _interpreter_config(*shape, num_splits=1)
    else:
        cfg = _gpu_config(queries_per_kv, head_padded, dtype, max_query_len)
    if max_query_len > cfg.block_q:
        # Query tiles of one sequence cannot share partial buffers: no split-KV.
        return _with_short_queries(cfg, target, queries_per_kv, head_padded, dtype, max_query_len)
    programs = num_seqs * triton.cdiv(num_kv_heads, cfg.kv_heads_per_program)  # unsplit
    if target.interpret:
        tile, per_sm, few = None, 1, False
    else:
        tile = _gpu_tile(head_padded, dtype, _phase(queries_per_kv, max_query_len))  # cfg's
        per_sm = tile.programs_per_sm
        few = _few_programs(programs, target.num_sms, per_sm)
    if num_splits is None and target.interpret:
        num_splits = 1
    elif num_splits is None:
        full_grid = _full_grid_tile(queries_per_kv, head_padded, dtype, max_query_len, programs, target)
        if full_grid is not None:  # fills the GPU unsplit
            cfg, num_splits = _with_tile(cfg, full_grid), 1
        else:
            chunk = _merge_chunk(cfg, head_padded, target, programs)
            busy = _unsplit_busy(tile, programs, head_padded * dtype.itemsize, target)
            num_splits = choose_num_splits(
                programs, target.num_sms, max_seq_len, cfg.tile_n, chunk, programs_per_sm=per_sm, unsplit_busy=busy
            )
            if 1 < num_splits <= _SPLIT_GRID_MAX_SPLITS:
                # A grid split a few ways fills the GPU like a batch that needs no split: the same tile rule.
                split_grid = _full_grid_tile(
                    queries_per_kv, head_padded, dtype, max_query_len, programs * num_splits, target
                )
                if split_grid is not None:
                    cfg = _with_tile(cfg, split_grid)
    if num_splits == 1:
        return _with_short_queries(cfg, target, queries_per_kv, head_padded, dtype, max_query_len)
    if target.interpret:
        cfg = _interpreter_config(*shape, num_splits=num_splits)  # shorter KV tiles, so each split gets some
    # Partial elements per merge program: ~8K on a GPU (registers); up to 2^18 under the interpreter (few programs).
    budget = 1 << 18 if target.interpret else 8192
    merge_heads = triton.next_power_of_2(num_heads)
    merge_heads = min(merge_heads, max(1, budget // (triton.next_power_of_2(num_splits) * head_padded)))
    return dataclasses.replace(
        cfg,
        num_splits=num_splits,
        merge_heads_per_program=merge_heads,
        merge_in_launch=num_splits <= _MERGE_IN_LAUNCH_MAX_SPLITS and not few,
        merge_chunk=min(
            _merge_chunk(cfg, head_padded, target, programs * num_splits), triton.next_power_of_2(num_splits)
        ),
    )


def _with_tile(cfg: PagedAttentionConfig, tile: _Tile) -> PagedAttentionConfig:
    return dataclasses.replace(cfg, tile_n=tile.tile_n, num_warps=tile.num_warps, num_stages=tile.num_stages)


def _merge_chunk(cfg: PagedAttentionConfig, head_padded: int, target: AttentionTarget, grid: int) -> int:
    """Splits the in-launch merge of a `grid`-program launch reads at a time, a power of two: [block_m, chunk,
    columns] fp32 in _MERGE_REGISTERS registers a thread on a GPU (_MERGE_REGISTERS_FULL_GRID past
    _SPLIT_PROGRAMS_PER_SM programs per SM); under the interpreter (whose cost is per op, not per element) as many
    as Triton's largest tile (2^20 elements) holds."""
    if target.interpret:
        elements = 1 << 20
    elif grid > _SPLIT_PROGRAMS_PER_SM * target.num_sms:
        elements = _MERGE_REGISTERS_FULL_GRID * 32 * cfg.num_warps
    else:
        elements = _MERGE_REGISTERS * 32 * cfg.num_warps
    columns = triton.next_power_of_2(cfg.kv_heads_per_program) * head_padded
    chunk = elements // (cfg.block_m * columns)
    return max(1, triton.next_power_of_2(chunk + 1) // 2)


def decode_tiles(head_size: int, dtype: torch.dtype) -> dict[str, tuple[int, int, int]]:
    """The GPU table's decode tiles for this head size, by entry name: (tile_n, num_warps, num_stages). For
    benchmarks that force each tile on a grid the plan would give one of them."""
    head_padded = max(64, triton.next_power_of_2(head_size))
    return {
        phase: (tile.tile_n, tile.num_warps, tile.num_stages)
        for (size, phase), tile in _gpu_table(dtype).items()
        if size == head_padded and phase.startswith("decode")
    }


def _phase(queries_per_kv: int, max_query_len: int) -> str:
    return "decode" if max_query_len * queries_per_kv <= _DECODE_ROWS else "prefill"


def _gpu_table(dtype: torch.dtype) -> dict[tuple[int, str], _Tile]:
    return _HOPPER_FP32 if dtype == torch.float32 else _HOPPER_16BIT


def _gpu_tile(head_padded: int, dtype: torch.dtype, phase: str) -> _Tile | None:
    return _gpu_table(dtype).get((max(64, head_padded), phase))


def _full_grid_tile(
    queries_per_kv: int,
    head_padded: int,
    dtype: torch.dtype,
    max_query_len: int,
    programs: int,
    target: AttentionTarget,
) -> _Tile | None:
    """For a decode grid of `programs` >= num_sms unsplit programs where the table has a "decode_full_grid" tile:
    of the decode tiles that keep enough reads in flight (`_feed`; the widest whatever), the one whose last wave of
    resident programs is fullest, a grid within one wave counting as full; ties to the most resident. Else None."""
    num_sms = target.num_sms
    narrow = _gpu_tile(head_padded, dtype, "decode_full_grid")
    if narrow is None or programs < num_sms or _phase(queries_per_kv, max_query_len) != "decode":
        return None
    crowded, wide = _gpu_tile(head_padded, dtype, "decode_crowded"), _gpu_tile(head_padded, dtype, "decode")
    tiles = [t for t in (crowded, narrow, wide) if t is not None]  # most resident first
    fed = [t for t in tiles if _feed(t, programs / num_sms, head_padded * dtype.itemsize, target) >= 1.0] or [wide]

    def last_wave_fill(tile: _Tile) -> float:
        resident = tile.programs_per_sm * num_sms
        return 1.0 if programs <= resident else programs / (triton.cdiv(programs, resident) * resident)

    return max(fed, key=last_wave_fill)  # the first of equals: the most resident


def _feed(tile: _Tile, programs_per_sm: float, row_bytes: int, target: AttentionTarget) -> float:
    """The share of its SM's part of the DRAM bandwidth that `programs_per_sm` programs of `tile` keep busy, each
    with one K and one V tile of `row_bytes` rows in flight for the tile's read latency (Little's law; >= 1: all)."""
    in_flight = programs_per_sm * tile.tile_n * 2 * row_bytes
    return in_flight / (target.dram_gbs / target.num_sms * 1e3 * tile.read_latency_us)


def _unsplit_busy(tile: _Tile, programs: int, row_bytes: int, target: AttentionTarget) -> float:
    """Share of the DRAM bandwidth an unsplit grid of `programs` (fewer than SMs) of `tile` draws: the SMs it
    occupies, one program each, each as far as that program's K and V tile reads in flight feed it."""
    fed = min(1.0, _feed(tile, 1, row_bytes, target))
    return programs / target.num_sms * fed


def _gpu_config(queries_per_kv: int, head_padded: int, dtype: torch.dtype, max_query_len: int) -> PagedAttentionConfig:
    rows = max_query_len * queries_per_kv
    phase = _phase(queries_per_kv, max_query_len)
    tile = _gpu_tile(head_padded, dtype, phase)
    block_m = tile.block_m
    if phase == "decode":
        block_m = min(block_m, max(16, triton.next_power_of_2(rows)))
    block_m = max(block_m, triton.next_power_of_2(queries_per_kv))  # one token's GQA group always fits
    return PagedAttentionConfig(
        block_m=block_m,
        block_q=block_m // queries_per_kv,
        tile_n=tile.tile_n,
        kv_heads_per_program=1,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def _with_short_queries(
    cfg: PagedAttentionConfig,
    target: AttentionTarget,
    queries_per_kv: int,
    head_padded: int,
    dtype: torch.dtype,
    max_query_len: int,
) -> PagedAttentionConfig:
    """cfg plus a decode-tiled launch for the short queries, where cfg's tile is a GPU prefill one that may see
    some (the interpreter's single launch already sizes its tile to the batch)."""
    if target.interpret:
        return cfg
    short = _gpu_config(queries_per_kv, head_padded, dtype, max_query_len=1)
    if short.block_q >= min(cfg.block_q, max_query_len):
        return cfg
    return dataclasses.replace(cfg, short_queries=short)


def _interpreter_config(
    num_kv_heads: int,
    queries_per_kv: int,
    head_padded: int,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None,
    num_splits: int,
) -> PagedAttentionConfig:
    kv_heads = num_kv_heads if triton.next_power_of_2(num_kv_heads) * head_padded <= _INTERP_MAX_COLS else 1
    rows_per_token = kv_heads * queries_per_kv
    block_q = min(max_query_len, max(1, _INTERP_MAX_ROWS // rows_per_token))
    block_m = triton.next_power_of_2(block_q * rows_per_token)
    # The keys one query tile can see: the whole context, or its window plus the tile's own span.
    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_q)
    span = triton.cdiv(span, max(1, num_splits))  # a forced split-KV still gets a tile per split
    tile_n = min(max(16, triton.next_power_of_2(span)), _INTERP_MAX_TILE_N)
    return PagedAttentionConfig(
        block_m=block_m,
        block_q=block_m // rows_per_token,
        tile_n=tile_n,
        kv_heads_per_program=kv_heads,
        num_warps=1,
        num_stages=1,
    )


def check_config(cfg: PagedAttentionConfig, num_kv_heads: int, queries_per_kv: int, max_query_len: int) -> None:
    """Raise a ValueError naming the problem when `cfg` cannot run this batch correctly."""
    pow2 = lambda x: x >= 1 and x & (x - 1) == 0
    if cfg.kv_heads_per_program not in (1, num_kv_heads):
        raise ValueError(f"config.kv_heads_per_program must be 1 or num_kv_heads ({num_kv_heads}), got {cfg}")
    rows_per_token = cfg.kv_heads_per_program * queries_per_kv
    if not all(pow2(x) for x in (cfg.block_m, cfg.tile_n, cfg.merge_heads_per_program, cfg.merge_chunk)):
        raise ValueError(
            f"config.block_m, tile_n, merge_heads_per_program and merge_chunk must be powers of two, got {cfg}"
        )
    if cfg.block_q < 1 or cfg.block_q * rows_per_token > cfg.block_m:
        raise ValueError(
            f"config.block_m {cfg.block_m} must hold block_q {cfg.block_q} tokens x {rows_per_token} heads; "
            "build it with paged_attention_config()"
        )
    if cfg.split_min_tiles < 1:
        raise ValueError(f"config.split_min_tiles must be >= 1, got {cfg.split_min_tiles}")
    if cfg.num_splits < 1 or (cfg.num_splits > 1 and max(1, max_query_len) > cfg.block_q):
        raise ValueError(
            f"config.num_splits {cfg.num_splits} needs every sequence in one query tile (max_query_len "
            f"{max_query_len} <= block_q {cfg.block_q}); use num_splits=1 for this batch"
        )
    short = cfg.short_queries
    if short is not None:
        if cfg.num_splits != 1 or short.short_queries is not None or short.num_splits != 1:
            raise ValueError(
                f"config.short_queries needs num_splits=1 on both configs and no short_queries of its own, got {cfg}"
            )
        if short.block_q >= cfg.block_q:
            raise ValueError(f"config.short_queries.block_q must be below block_q {cfg.block_q}, got {short}")
        check_config(short, num_kv_heads, queries_per_kv, short.block_q)
