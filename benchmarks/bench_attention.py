"""Paged attention against torch SDPA and the copy bandwidth measured in the same run (not run by CI).

    python benchmarks/bench_attention.py --out results/            # ~1-2 min on an H200
    python benchmarks/bench_attention.py --out results/ --sweep    # + launch-config sweep for the Hopper table
    python benchmarks/bench_attention.py --out /tmp/smoke --tiny   # toy shapes, any device (CPU: interpreter)
    python benchmarks/bench_attention.py --out results/ --head-dim 64 --sweep --only-extra  # another head size
    python benchmarks/bench_attention.py --out results/ --only-extra --tile-sweep --batches 32,64 --contexts 1024

Decode: one query token per sequence, batch 1..256 x context 512..8k, 32 query / 8 KV heads of 128, bf16, KV
blocks of 16 scattered over the cache in random order. Ours reads the paged cache; SDPA reads the same K/V laid
out contiguously ([B, 8, S, 128], GQA without copies). Both run as CUDA graph replays (as decode runs in the
engine), with L2 flushed before each replay so K/V come from HBM. Effective bandwidth = (K + V + q + out bytes)
/ time, also as a fraction of the copy bandwidth (a 4 GiB tensor cloned: bytes read + written per second).
Prefill: causal self-attention of fresh sequences (query_len = seq_len), TFLOP/s counting the causal half.
Writes attention.json and attention.md to --out.

--sweep times every decode/prefill launch configuration in a grid on a subset of the shapes and reports the best
per shape and per table entry: the numbers for `_HOPPER_16BIT` and the split-KV knobs in
tritonllm/kernels/paged_attention_config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    STREAM_BYTES,
    bench_device,
    environment,
    fixed_and_rate,
    log,
    markdown_table,
    stream_us,
    time_ms,
    write_results,
)

from tritonllm.kernels.paged_attention import paged_attention  # noqa: E402
from tritonllm.kernels.paged_attention_config import (  # noqa: E402
    PagedAttentionConfig,
    current_target,
    decode_tiles,
    paged_attention_config,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 1024, 4096, 8192)
PREFILL_LENS = (512, 2048, 8192)
PREFILL_TOKENS = 16384  # batch = PREFILL_TOKENS // length
SWEEP_DECODE = [(1, 1024), (1, 8192), (8, 4096), (32, 1024), (64, 8192), (256, 1024)]
SWEEP_PREFILL = (512, 2048)
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8)  # split-KV counts tried at batch >= 32, where the heuristic picks 1
# Mixed steps (decodes next to one prefill chunk, as continuous batching schedules them): (decodes, their context,
# chunk length), planned as a mixed-step CUDA graph plans them, for the token count rounded up to 256.
MIXED_STEPS = ((255, 512, 256), (255, 1024, 1024), (128, 2048, 2048), (32, 4096, 512))
# Small-batch decode as a decode graph captured at max_model_len plans it (--graph-splits): the split count is
# chosen for GRAPH_MAX_SEQ_LEN whatever the context, so short contexts leave most splits empty.
GRAPH_MAX_SEQ_LEN = 4096
GRAPH_BATCHES = (1, 4)
GRAPH_CONTEXTS = (256, 512, 1024, 4096)
GRAPH_SPLITS = (1, 4, 8, 16, 32)
# Decode as a model step runs it (--chain): one CUDA graph calls attention once per layer, each layer over its own
# K/V (all layers together past L2), replayed back to back, so each call pays the gaps between kernels of a step
# but no graph launch of its own. Forced split counts x merge (in the launch, 4 or 8 splits a step; a merge launch).
CHAIN_BATCHES = (1, 2, 4, 8)
CHAIN_CONTEXTS = (1024, 4096, 8192, 16384, 32768)
CHAIN_SPLITS = (1, 2, 4, 8, 16, 32, 64)
CHAIN_MERGES = (("in launch x4", True, 4), ("in launch x8", True, 8), ("merge launch", False, 4))
CHAIN_TILES = ((32, 4), (64, 4), (64, 5), (128, 4), (128, 5))  # (tile_n, stages) tried at batch 1
CHAIN_SPLIT_MIN_TILES = (1, 2, 4, 8)  # the default plan with each split walking at least this many KV tiles
MAX_DIFF = 0.05  # bf16 outputs of unit-variance attention: a larger gap to SDPA means a wrong result


@dataclasses.dataclass(slots=True)
class Shapes:
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    block: int = BLOCK
    batches: tuple[int, ...] = DECODE_BATCHES
    contexts: tuple[int, ...] = DECODE_CONTEXTS
    prefill_lens: tuple[int, ...] = PREFILL_LENS
    prefill_tokens: int = PREFILL_TOKENS
    sweep_decode: tuple[tuple[int, int], ...] = tuple(SWEEP_DECODE)
    sweep_prefill: tuple[int, ...] = SWEEP_PREFILL
    mixed_steps: tuple[tuple[int, int, int], ...] = MIXED_STEPS
    chain_batches: tuple[int, ...] = CHAIN_BATCHES
    chain_contexts: tuple[int, ...] = CHAIN_CONTEXTS
    chain_splits: tuple[int, ...] = CHAIN_SPLITS


TINY = Shapes(
    heads=4,
    kv_heads=2,
    head_dim=32,
    batches=(1, 3),
    contexts=(48, 96),
    prefill_lens=(32,),
    prefill_tokens=64,
    sweep_decode=((1, 96),),
    sweep_prefill=(32,),
    mixed_steps=((3, 48, 16),),
    chain_batches=(1,),
    chain_contexts=(96,),
)


def time_graph_ms(fn: Callable[[], object], device: torch.device, reps: int = 30) -> float:
    """Median milliseconds of one replay of `fn` captured in a CUDA graph, L2 flushed before each replay.

    The flush reads 256 MiB (~0.1 ms): it keeps the GPU busy while the host enqueues the replay, so the events time
    the kernels alone, with no launch gaps, and it leaves L2 full of clean lines, as the weight reads before an
    attention layer do (a memset would leave dirty lines whose write-back the timed kernel would pay for: ~12 us
    for the H200's 50 MB L2, a third of a batch-32, 1k-context decode). Elsewhere: a wall-clock median.
    """
    if device.type != "cuda":
        return time_ms(fn, device, warmup_ms=1, rep_ms=20)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.ones(64 << 20, dtype=torch.int32, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    graph.replay()
    for start, end in zip(starts, ends, strict=True):
        flush.sum()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    return times[len(times) // 2]


def clone_bandwidth_gbs(device: torch.device, nbytes: int) -> float:
    """(bytes read + bytes written) / time of cloning a `nbytes` tensor: the bandwidth a large copy achieves."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    ms = time_ms(lambda: src.clone(), device, warmup_ms=50, rep_ms=400)
    return 2 * nbytes / (ms * 1e-3) / 1e9


@dataclasses.dataclass(slots=True)
class PagedKV:
    """The same random K/V twice: scattered over a paged cache, and contiguous for SDPA."""

    k_cache: torch.Tensor  # [num_blocks, block, Hk, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, S / block] int32, a random permutation of the blocks
    k: torch.Tensor  # [B, Hk, S, D]
    v: torch.Tensor


def make_kv(batch: int, context: int, s: Shapes, dtype: torch.dtype, device: torch.device, seed: int) -> PagedKV:
    if context % s.block:
        raise ValueError(f"context {context} must be a multiple of the block size {s.block}")
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(batch, s.kv_heads, context, s.head_dim, generator=g, device=device, dtype=dtype)
    v = torch.randn(batch, s.kv_heads, context, s.head_dim, generator=g, device=device, dtype=dtype)
    blocks = context // s.block
    perm = torch.randperm(batch * blocks, generator=g, device=device)
    caches = []
    for x in (k, v):
        # [B, Hk, S, D] -> [B * S / block, block, Hk, D], then block j of sequence b to physical block perm[...].
        paged = x.view(batch, s.kv_heads, blocks, s.block, s.head_dim).permute(0, 2, 3, 1, 4)
        cache = torch.empty(batch * blocks, s.block, s.kv_heads, s.head_dim, dtype=dtype, device=device)
        cache[perm] = paged.reshape(batch * blocks, s.block, s.kv_heads, s.head_dim)
        caches.append(cache)
    tables = perm.view(batch, blocks).to(torch.int32)
    return PagedKV(caches[0], caches[1], tables, k, v)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _target(device: torch.device):
    return current_target(device.index or 0) if device.type == "cuda" else None


@dataclasses.dataclass(slots=True)
class Case:
    """One batch: `ours(config)` and `sdpa()` are callables over the same inputs."""

    ours: Callable[[PagedAttentionConfig], Callable[[], None]]
    sdpa: Callable[[], torch.Tensor]
    check: Callable[[PagedAttentionConfig], float]  # max |ours - sdpa|
    config: PagedAttentionConfig  # what paged_attention chooses by itself
    work: float  # decode: bytes moved; prefill: FLOPs
    batch: int


def _case(batch, query_len, context, s, dtype, device, seed: int = 0) -> Case:
    kv = make_kv(batch, context, s, dtype, device, seed=batch * 100003 + context + seed * 7919)
    g = torch.Generator(device=device).manual_seed(context + query_len + seed)
    q = torch.randn(batch * query_len, s.heads, s.head_dim, generator=g, device=device, dtype=dtype)
    out = torch.empty_like(q)
    i32 = dict(dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, batch * query_len + 1, query_len, **i32)
    seq_lens = torch.full((batch,), context, **i32)
    scale = s.head_dim**-0.5
    config = paged_attention_config(
        num_seqs=batch,
        num_heads=s.heads,
        num_kv_heads=s.kv_heads,
        head_size=s.head_dim,
        dtype=dtype,
        max_query_len=query_len,
        max_seq_len=context,
        target=_target(device),
    )

    def ours(cfg: PagedAttentionConfig) -> Callable[[], None]:
        def call():
            paged_attention(
                q, kv.k_cache, kv.v_cache, query_start_loc, seq_lens, kv.block_tables, query_len, context, scale,
                out=out, config=cfg,
            )  # fmt: skip

        return call

    q4 = q.view(batch, query_len, s.heads, s.head_dim).transpose(1, 2)  # [B, Hq, L, D]
    causal = query_len > 1

    def theirs() -> torch.Tensor:
        return sdpa(q4, kv.k, kv.v, causal=causal)

    def check(cfg: PagedAttentionConfig) -> float:
        ours(cfg)()
        ref = theirs().transpose(1, 2).reshape_as(out)
        return (out.float() - ref.float()).abs().max().item()

    elem = torch.finfo(dtype).bits // 8
    if query_len == 1:
        work = 2 * batch * context * s.kv_heads * s.head_dim * elem + 2 * q.numel() * elem
    else:  # QK^T and PV over the causal half
        work = 4 * batch * s.heads * s.head_dim * query_len * (query_len + 1) / 2
    return Case(ours, theirs, check, config, work, batch)


def decode_case(batch: int, context: int, s: Shapes, dtype, device, seed: int = 0) -> Case:
    return _case(batch, 1, context, s, dtype, device, seed)


def prefill_case(length: int, s: Shapes, dtype, device) -> Case:
    return _case(max(1, s.prefill_tokens // length), length, length, s, dtype, device)


def run_decode(s, dtype, device, copy_gbs) -> list[dict]:
    rows = []
    for batch, context in itertools.product(s.batches, s.contexts):
        case = decode_case(batch, context, s, dtype, device)
        err = case.check(case.config)
        if err > MAX_DIFF:
            log(f"WARNING: decode B={batch} S={context} differs from SDPA by {err:.3g}")
        t_ours = time_graph_ms(case.ours(case.config), device)
        t_sdpa = time_graph_ms(case.sdpa, device)
        row = dict(
            batch=batch,
            context=context,
            num_splits=case.config.num_splits,
            ours_us=t_ours * 1e3,
            ours_gbs=case.work / (t_ours * 1e-3) / 1e9,
            sdpa_us=t_sdpa * 1e3,
            sdpa_gbs=case.work / (t_sdpa * 1e-3) / 1e9,
            max_abs_diff=err,
            config=dataclasses.asdict(case.config),
        )
        row["ours_pct_copy"] = 100 * row["ours_gbs"] / copy_gbs
        row["sdpa_pct_copy"] = 100 * row["sdpa_gbs"] / copy_gbs
        log(
            f"decode B={batch:3d} S={context:5d} splits={case.config.num_splits:2d}: ours {row['ours_us']:8.1f} us "
            f"{row['ours_pct_copy']:5.1f}% | sdpa {row['sdpa_us']:8.1f} us {row['sdpa_pct_copy']:5.1f}% | "
            f"diff {err:.2g}"
        )
        rows.append(row)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_prefill(s, dtype, device) -> list[dict]:
    rows = []
    for length in s.prefill_lens:
        case = prefill_case(length, s, dtype, device)
        err = case.check(case.config)
        if err > MAX_DIFF:
            log(f"WARNING: prefill L={length} differs from SDPA by {err:.3g}")
        t_ours = time_ms(case.ours(case.config), device)
        t_sdpa = time_ms(case.sdpa, device)
        row = dict(
            length=length,
            batch=case.batch,
            ours_ms=t_ours,
            ours_tflops=case.work / (t_ours * 1e-3) / 1e12,
            sdpa_ms=t_sdpa,
            sdpa_tflops=case.work / (t_sdpa * 1e-3) / 1e12,
            max_abs_diff=err,
            config=dataclasses.asdict(case.config),
        )
        log(
            f"prefill L={length:5d} B={case.batch:3d}: ours {t_ours:7.3f} ms {row['ours_tflops']:6.1f} TF/s | "
            f"sdpa {t_sdpa:7.3f} ms {row['sdpa_tflops']:6.1f} TF/s | diff {err:.2g}"
        )
        rows.append(row)
    return rows


def mixed_case(decodes: int, context: int, chunk: int, s: Shapes, dtype, device):
    """(plan, run): the default plan of a mixed step padded to its 256-token bucket, and run(config) -> output."""
    kv = make_kv(decodes + 1, max(context, chunk), s, dtype, device, seed=decodes + context + chunk)
    g = torch.Generator(device=device).manual_seed(chunk)
    num_tokens = decodes + chunk
    bucket = -(-num_tokens // 256) * 256
    q = torch.randn(bucket, s.heads, s.head_dim, generator=g, device=device, dtype=dtype)
    i32 = dict(dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([*range(decodes + 1), num_tokens], **i32)
    seq_lens = torch.tensor([context] * decodes + [chunk], **i32)
    max_seq_len = max(context, chunk)
    config = paged_attention_config(
        num_seqs=decodes + 1, num_heads=s.heads, num_kv_heads=s.kv_heads, head_size=s.head_dim, dtype=dtype,
        max_query_len=bucket, max_seq_len=max_seq_len, target=_target(device),
    )  # fmt: skip

    def run(cfg: PagedAttentionConfig) -> tuple[Callable[[], None], torch.Tensor]:
        out = torch.zeros_like(q)
        return lambda: paged_attention(
            q, kv.k_cache, kv.v_cache, query_start_loc, seq_lens, kv.block_tables, bucket, max_seq_len,
            s.head_dim**-0.5, out=out, config=cfg,
        ), out[:num_tokens]  # fmt: skip

    return config, bucket, run


def run_mixed(s, dtype, device) -> list[dict]:
    """Mixed steps: the decodes in a launch of their own (the default plan) against one prefill-tiled launch."""
    rows = []
    for decodes, context, chunk in s.mixed_steps:
        config, bucket, run = mixed_case(decodes, context, chunk, s, dtype, device)
        (two, out_two), (one, out_one) = run(config), run(dataclasses.replace(config, short_queries=None))
        t_two, t_one = time_graph_ms(two, device), time_graph_ms(one, device)
        err = (out_two.float() - out_one.float()).abs().max().item()
        rows.append(
            dict(decodes=decodes, context=context, chunk=chunk, bucket=bucket, two_launches_us=t_two * 1e3,
                 one_launch_us=t_one * 1e3, max_abs_diff=err, short_queries=config.short_queries is not None)
        )  # fmt: skip
        log(
            f"mixed {decodes} decodes x {context} + chunk {chunk} (bucket {bucket}): two launches {t_two * 1e3:.1f} us,"
            f" one {t_one * 1e3:.1f} us, diff {err:.2g}"
        )
    return rows


def run_split_sweep(s, dtype, device, copy_gbs) -> list[dict]:
    """Decode at batch >= 32 (one program per sequence and KV head already fills the GPU) with forced KV splits."""
    rows = []
    for batch, context in itertools.product([b for b in s.batches if b >= 32] or s.batches[-1:], s.contexts):
        case = decode_case(batch, context, s, dtype, device)
        for n in SWEEP_SPLITS:
            cfg = paged_attention_config(
                num_seqs=batch, num_heads=s.heads, num_kv_heads=s.kv_heads, head_size=s.head_dim, dtype=dtype,
                max_query_len=1, max_seq_len=context, num_splits=n, target=_target(device),
            )  # fmt: skip
            t = time_graph_ms(case.ours(cfg), device)
            pct = _pct_copy(case.work, t, copy_gbs)
            rows.append(dict(batch=batch, context=context, num_splits=cfg.num_splits, us=t * 1e3, pct_copy=pct))
        mine = rows[-len(SWEEP_SPLITS) :]
        log(f"splits B={batch} S={context}: " + " ".join(f"{r['num_splits']}:{r['pct_copy']:.0f}%" for r in mine))
        del case
    return rows


def run_tile_sweep(s, dtype, device, copy_gbs) -> list[dict]:
    """Decode at every batch x context: the plan against each of the table's decode tiles forced unsplit (% of
    copy bandwidth), and SDPA: what the rule in `_full_grid_tile` is checked against."""
    rows = []
    tiles = decode_tiles(s.head_dim, dtype)
    for context, batch in itertools.product(s.contexts, s.batches):
        case = decode_case(batch, context, s, dtype, device)
        plan = case.config
        row = dict(batch=batch, context=context, plan=_tile_label(plan), pct_copy={})
        configs = {"plan": plan}
        for tile_n, warps, stages in tiles.values():
            cfg = dataclasses.replace(plan, tile_n=tile_n, num_warps=warps, num_stages=stages, num_splits=1)
            configs[_tile_label(cfg)] = cfg
        for name, cfg in configs.items():
            err = case.check(cfg)
            if err > MAX_DIFF:
                log(f"WARNING: tile sweep B={batch} S={context} {name} differs from SDPA by {err:.3g}")
            t = time_graph_ms(case.ours(cfg), device)
            row["pct_copy"][name] = _pct_copy(case.work, t, copy_gbs)
        t = time_graph_ms(case.sdpa, device)
        row["pct_copy"]["sdpa"] = _pct_copy(case.work, t, copy_gbs)
        log(
            f"tiles B={batch} S={context} plan {row['plan']}: "
            + " ".join(f"{name} {pct:.1f}%" for name, pct in row["pct_copy"].items())
        )
        rows.append(row)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _pct_copy(work: float, ms: float, copy_gbs: float) -> float:
    """Bytes moved in `ms` milliseconds as a percentage of the copy bandwidth."""
    return 100 * work / (ms * 1e-3) / 1e9 / copy_gbs


def _tile_label(cfg: PagedAttentionConfig) -> str:
    splits = f", {cfg.num_splits} splits" if cfg.num_splits > 1 else ""
    return f"{cfg.tile_n} keys, {cfg.num_warps} warps, {cfg.num_stages} stages{splits}"


def run_graph_splits(s, dtype, device, copy_gbs) -> list[dict]:
    """Batch 1-4 decode planned for GRAPH_MAX_SEQ_LEN at shorter contexts: each forced split count, merged by the
    last split program ("in launch") or by a merge launch, against the count the heuristics choose ("default")."""
    rows = []
    for batch, context in itertools.product(GRAPH_BATCHES, GRAPH_CONTEXTS):
        case = decode_case(batch, context, s, dtype, device)
        plan = dict(
            num_seqs=batch, num_heads=s.heads, num_kv_heads=s.kv_heads, head_size=s.head_dim, dtype=dtype,
            max_query_len=1, max_seq_len=GRAPH_MAX_SEQ_LEN, target=_target(device),
        )  # fmt: skip
        default = paged_attention_config(**plan)
        for n in GRAPH_SPLITS:
            cfg = paged_attention_config(**plan, num_splits=n)
            for in_launch in (True, False) if cfg.num_splits > 1 else (True,):
                cfg = dataclasses.replace(cfg, merge_in_launch=in_launch)
                err = case.check(cfg)
                t = time_graph_ms(case.ours(cfg), device)
                label = f"{n} " + ("in launch" if in_launch else "merge launch") if n > 1 else "1"
                rows.append(
                    dict(
                        batch=batch, context=context, config=label, is_default=cfg == default, us=t * 1e3,
                        pct_copy=_pct_copy(case.work, t, copy_gbs), max_abs_diff=err,
                    )
                )  # fmt: skip
        mine = [r for r in rows if (r["batch"], r["context"]) == (batch, context)]
        log(f"graph splits B={batch} S={context}: " + " | ".join(f"{r['config']}: {r['us']:.1f} us" for r in mine))
        del case
    return rows


def _chain_configs(batch: int, context: int, s: Shapes, dtype, device) -> dict[str, PagedAttentionConfig]:
    plan = dict(
        num_seqs=batch, num_heads=s.heads, num_kv_heads=s.kv_heads, head_size=s.head_dim, dtype=dtype,
        max_query_len=1, max_seq_len=context, target=_target(device),
    )  # fmt: skip
    default = paged_attention_config(**plan)
    configs = {"default": default}
    if default.num_splits > 1:
        for min_tiles in CHAIN_SPLIT_MIN_TILES:
            cfg = dataclasses.replace(default, split_min_tiles=min_tiles)
            configs.setdefault(f"{cfg.num_splits} splits of >= {min_tiles} tiles", cfg)
    for n, (merge, in_launch, chunk) in itertools.product(s.chain_splits, CHAIN_MERGES):
        cfg = dataclasses.replace(
            paged_attention_config(**plan, num_splits=n), merge_in_launch=in_launch, merge_chunk=chunk
        )
        if cfg.num_splits == 1:  # nothing to merge (--chain-match "split" takes it with the split counts)
            configs.setdefault("1 split, no merge", cfg)
        else:
            configs.setdefault(f"{cfg.num_splits} splits, {merge}", cfg)
    if batch == 1:
        for (tile_n, stages), (merge, in_launch, chunk) in itertools.product(CHAIN_TILES, CHAIN_MERGES):
            cfg = dataclasses.replace(
                default, tile_n=tile_n, num_stages=stages, merge_in_launch=in_launch, merge_chunk=chunk
            )
            configs.setdefault(f"{cfg.num_splits} splits, {merge}, tile_n {tile_n}, {stages} stages", cfg)
    return configs


def run_chain(s, dtype, device, copy_gbs, default_only: bool = False, match: str | None = None) -> list[dict]:
    """Small-batch decode timed per layer inside one graph of a step's worth of layers (see CHAIN_BATCHES); only
    the default plan with `default_only`, else every config or those whose label contains `match`."""
    rows = []
    for batch, context in itertools.product(s.chain_batches, s.chain_contexts):
        rows.append(_chain_row(batch, context, s, dtype, device, copy_gbs, default_only, match))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _chain_row(
    batch: int, context: int, s: Shapes, dtype, device, copy_gbs: float, default_only: bool, match: str | None
) -> dict:
    first = decode_case(batch, context, s, dtype, device)
    layers = max(2, -(-STREAM_BYTES // int(first.work))) if device.type == "cuda" else 1
    cases = [first] + [decode_case(batch, context, s, dtype, device, seed=i) for i in range(1, layers)]
    sdpa_us = stream_us(lambda f: f(), [c.sdpa for c in cases], device)
    timed = {}
    configs = _chain_configs(batch, context, s, dtype, device)
    if default_only or match:
        configs = {k: v for k, v in configs.items() if k == "default" or (match and match in k)}
    for label, cfg in configs.items():
        result = _try_time(
            label, lambda cfg=cfg: (first.check(cfg), stream_us(lambda f: f(), [c.ours(cfg) for c in cases], device))
        )
        if result is None:
            continue
        err, timed[label] = result
        if err > MAX_DIFF:
            log(f"WARNING: chain B={batch} S={context} {label} differs from SDPA by {err:.3g}")
    best = min(timed, key=timed.get)

    def pct(us: float) -> float:
        return 100 * first.work / (us * 1e-6) / 1e9 / copy_gbs

    log(
        f"chain B={batch} S={context} ({layers} layers): default {timed['default']:.1f} us "
        f"{pct(timed['default']):.0f}% | best {best}: {timed[best]:.1f} us {pct(timed[best]):.0f}% | "
        f"sdpa {sdpa_us:.1f} us {pct(sdpa_us):.0f}%"
    )
    return dict(
        batch=batch, context=context, bytes=first.work, layers=layers, default=first.config.num_splits,
        default_us=timed["default"], default_pct_copy=pct(timed["default"]), best=best, best_us=timed[best],
        best_pct_copy=pct(timed[best]), sdpa_us=sdpa_us, sdpa_pct_copy=pct(sdpa_us), all_us=timed,
    )  # fmt: skip


def chain_fits(rows: list[dict], copy_gbs: float) -> list[dict]:
    """Per batch timed at two or more contexts, the plan's and SDPA's time split into a fixed part and a streaming
    rate (bench_utils.fixed_and_rate): how far a target at one context is from what the other sizes predict."""
    fits = []
    for batch in dict.fromkeys(r["batch"] for r in rows):
        mine = [r for r in rows if r["batch"] == batch]
        if len({r["context"] for r in mine}) < 2:
            continue
        fit = dict(batch=batch, contexts=",".join(str(r["context"]) for r in mine))
        for who, key in (("ours", "default_us"), ("sdpa", "sdpa_us")):
            fixed, gbs = fixed_and_rate([r["bytes"] for r in mine], [r[key] for r in mine])
            fit |= {f"{who}_fixed_us": fixed, f"{who}_gbs": gbs, f"{who}_pct_copy": 100 * gbs / copy_gbs}
        log(
            f"chain fit B={batch}: plan {fit['ours_fixed_us']:.2f} us + KV at {fit['ours_gbs']:,.0f} GB/s "
            f"({fit['ours_pct_copy']:.0f}% of copy) | sdpa {fit['sdpa_fixed_us']:.2f} us + {fit['sdpa_gbs']:,.0f} GB/s"
        )
        fits.append(fit)
    return fits


def _rank_tiles(rows: list[dict], key: str) -> list[dict]:
    """Tiles timed on every shape, by the geometric mean over shapes of (time / that shape's best time)."""
    best: dict[str, float] = {}
    per_tile: dict[str, dict[str, float]] = {}
    for r in rows:
        best[r["shape"]] = min(best.get(r["shape"], math.inf), r[key])
        tile = per_tile.setdefault(r["tile"], {})
        tile[r["shape"]] = min(tile.get(r["shape"], math.inf), r[key])  # a tile's best split count per shape
    ranked = sorted(
        (math.exp(sum(math.log(t / best[shape]) for shape, t in times.items()) / len(times)), tile)
        for tile, times in per_tile.items()
        if len(times) == len(best)
    )
    return [dict(tile=tile, slowdown_vs_best=score) for score, tile in ranked[:8]]


def _fastest(rows: list[dict], shape: str, key: str) -> dict | None:
    """The sweep row of `shape` with the smallest `key`, or None when none of its configs ran."""
    return min((r for r in rows if r["shape"] == shape), key=lambda r: r[key], default=None)


def _vs_default(rows: list[dict], shape: str, key: str, scale: float) -> str:
    """A progress line's note of the default launch's time: a stopped sweep still compares the table's entry."""
    default = next((r for r in rows if r["shape"] == shape and r["is_default"]), None)
    return "" if default is None else f" (the default: {default[key] * scale:.1f} us)"


def _try_time(label: str, make: Callable[[], tuple[float, float]]) -> tuple[float, float] | None:
    try:
        return make()
    except Exception as e:  # noqa: BLE001  (a config that does not fit the GPU is a data point, not a failure)
        log(f"sweep {label}: {type(e).__name__}: {str(e)[:120]}")
        return None


def run_sweep(s, dtype, device, copy_gbs) -> dict:
    """Time a grid of launch configs; report the best per shape and the best single tile for the table."""
    decode = []
    for batch, context in s.sweep_decode:
        case = decode_case(batch, context, s, dtype, device)
        base = case.config
        splits = sorted({1, base.num_splits, max(1, base.num_splits // 2), min(64, 2 * base.num_splits)})
        configs = [base]  # the default first, then the grid
        for tile_n, warps, stages, n in itertools.product((32, 64, 128), (4, 8), (3, 4, 5, 6), splits):
            cfg = paged_attention_config(
                num_seqs=batch,
                num_heads=s.heads,
                num_kv_heads=s.kv_heads,
                head_size=s.head_dim,
                dtype=dtype,
                max_query_len=1,
                max_seq_len=context,
                num_splits=n,
                target=_target(device),
            )
            cfg = dataclasses.replace(cfg, tile_n=tile_n, num_warps=warps, num_stages=stages)
            if cfg != base:
                configs.append(cfg)
        for cfg in configs:
            tile = f"tile_n={cfg.tile_n} warps={cfg.num_warps} stages={cfg.num_stages}"
            label = f"decode B={batch} S={context} {tile} splits={cfg.num_splits}"
            timed = _try_time(
                label, lambda cfg=cfg, case=case: (case.check(cfg), time_graph_ms(case.ours(cfg), device, 15))
            )
            if timed is None:
                continue
            err, t = timed
            decode.append(
                dict(
                    shape=f"B={batch} S={context}",
                    tile=tile,
                    num_splits=cfg.num_splits,
                    us=t * 1e3,
                    pct_copy=_pct_copy(case.work, t, copy_gbs),
                    max_abs_diff=err,
                    is_default=cfg is base,
                )
            )
        top = _fastest(decode, f"B={batch} S={context}", "us")
        if top:
            vs = _vs_default(decode, top["shape"], "us", 1.0)
            log(f"sweep decode {top['shape']}: best {top['tile']} splits={top['num_splits']} {top['us']:.1f} us{vs}")
    prefill = []
    for length in s.sweep_prefill:
        case = prefill_case(length, s, dtype, device)
        rows_per_token = s.heads // s.kv_heads * case.config.kv_heads_per_program
        configs = [case.config]
        for block_m, tile_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            cfg = dataclasses.replace(
                case.config, block_m=block_m, block_q=max(1, block_m // rows_per_token), tile_n=tile_n,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
            if cfg != case.config:
                configs.append(cfg)
        for cfg in configs:
            tile = f"block_m={cfg.block_m} tile_n={cfg.tile_n} warps={cfg.num_warps} stages={cfg.num_stages}"
            timed = _try_time(
                f"prefill L={length} {tile}",
                lambda cfg=cfg, case=case: (case.check(cfg), time_ms(case.ours(cfg), device, rep_ms=50)),
            )
            if timed is None:
                continue
            err, t = timed
            prefill.append(
                dict(
                    shape=f"L={length}",
                    tile=tile,
                    ms=t,
                    tflops=case.work / (t * 1e-3) / 1e12,
                    max_abs_diff=err,
                    is_default=cfg is case.config,
                )
            )
        top = _fastest(prefill, f"L={length}", "ms")
        if top:
            vs = _vs_default(prefill, top["shape"], "ms", 1e3)
            log(f"sweep prefill {top['shape']}: best {top['tile']} {top['ms'] * 1e3:.1f} us{vs}")
    return dict(
        decode=decode,
        prefill=prefill,
        decode_best_tiles=_rank_tiles(decode, "us"),
        prefill_best_tiles=_rank_tiles(prefill, "ms"),
    )


def render(results: dict) -> str:
    env, copy_gbs = results["environment"], results["copy_gbs"]
    parts = [
        f"# Paged attention on {env['device']}",
        "",
        f"Copy bandwidth (clone of a {results['copy_bytes'] / 2**30:g} GiB tensor, read + write): "
        f"**{copy_gbs:,.0f} GB/s**. "
        f"{results['shapes']}, {results['dtype']}.",
        "",
        "## Decode (one query per sequence; CUDA graph replays, L2 flushed)",
        "",
        markdown_table(
            [
                "batch",
                "context",
                "splits",
                "ours us",
                "ours GB/s",
                "ours % copy",
                "SDPA us",
                "SDPA GB/s",
                "SDPA % copy",
                "SDPA / ours",
            ],
            [
                [
                    r["batch"],
                    r["context"],
                    r["num_splits"],
                    r["ours_us"],
                    r["ours_gbs"],
                    r["ours_pct_copy"],
                    r["sdpa_us"],
                    r["sdpa_gbs"],
                    r["sdpa_pct_copy"],
                    r["sdpa_us"] / r["ours_us"],
                ]
                for r in results["decode"]
            ],
        ),  # fmt: skip
        "",
        "## Prefill (causal, fresh sequences)",
        "",
        markdown_table(
            ["length", "batch", "ours ms", "ours TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "ours / SDPA"],
            [
                [
                    r["length"],
                    r["batch"],
                    r["ours_ms"],
                    r["ours_tflops"],
                    r["sdpa_ms"],
                    r["sdpa_tflops"],
                    r["ours_tflops"] / r["sdpa_tflops"],
                ]
                for r in results["prefill"]
            ],
        ),  # fmt: skip
    ]
    if results.get("mixed"):
        parts += [
            "",
            "## Mixed steps (decodes + one prefill chunk, planned for the token bucket; CUDA graph replays)",
            "",
            markdown_table(
                ["decodes", "context", "chunk", "bucket", "decodes apart us", "one launch us", "speed-up"],
                [
                    [
                        r["decodes"],
                        r["context"],
                        r["chunk"],
                        r["bucket"],
                        r["two_launches_us"],
                        r["one_launch_us"],
                        r["one_launch_us"] / r["two_launches_us"],
                    ]
                    for r in results["mixed"]
                ],
            ),  # fmt: skip
        ]
    if results.get("split_sweep"):
        rows = {}
        for r in results["split_sweep"]:
            rows.setdefault((r["batch"], r["context"]), [r["batch"], r["context"]]).append(r["pct_copy"])
        parts += [
            "",
            "## Split-KV at batch >= 32 (% of copy bandwidth per forced split count)",
            "",
            markdown_table(["batch", "context", *[f"{n} splits" for n in SWEEP_SPLITS]], list(rows.values())),
        ]
    if results.get("tile_sweep"):
        names = list(results["tile_sweep"][0]["pct_copy"])
        parts += [
            "",
            "## Decode tiles (% of copy bandwidth: the plan, each table tile forced unsplit, SDPA)",
            "",
            markdown_table(
                ["batch", "context", "plan", *[f"{name} %" for name in names]],
                [[r["batch"], r["context"], r["plan"], *r["pct_copy"].values()] for r in results["tile_sweep"]],
            ),
        ]
    if results.get("graph_splits"):
        labels = list(dict.fromkeys(r["config"] for r in results["graph_splits"]))
        rows = {}
        for r in results["graph_splits"]:
            row = rows.setdefault((r["batch"], r["context"]), [r["batch"], r["context"]] + [""] * len(labels))
            row[2 + labels.index(r["config"])] = f"{r['us']:.1f}" + (" (default)" if r["is_default"] else "")
        parts += [
            "",
            f"## Small-batch decode planned for max_seq_len {GRAPH_MAX_SEQ_LEN} (us per launch by KV splits)",
            "",
            markdown_table(["batch", "context", *labels], list(rows.values())),
        ]
    if results.get("chain"):
        columns = {
            "batch": "batch", "context": "context", "layers": "layers", "default": "default splits",
            "default_us": "default us", "default_pct_copy": "default % copy", "best": "best config",
            "best_us": "best us", "best_pct_copy": "best % copy", "sdpa_us": "SDPA us", "sdpa_pct_copy": "SDPA % copy",
        }  # fmt: skip
        parts += [
            "",
            "## Small-batch decode per layer inside a step's graph (one call per layer, each over its own KV)",
            "",
            markdown_table(list(columns.values()), [[r[k] for k in columns] for r in results["chain"]]),
        ]
    if results.get("chain_fit"):
        columns = {
            "batch": "batch", "contexts": "contexts", "ours_fixed_us": "plan: fixed us", "ours_gbs": "plan: GB/s",
            "ours_pct_copy": "plan: % copy", "sdpa_fixed_us": "SDPA: fixed us", "sdpa_gbs": "SDPA: GB/s",
            "sdpa_pct_copy": "SDPA: % copy",
        }  # fmt: skip
        parts += [
            "",
            "## The same as a fixed cost per call plus a streaming rate (least squares over the contexts)",
            "",
            markdown_table(list(columns.values()), [[r[k] for k in columns] for r in results["chain_fit"]]),
        ]
    if "sweep" in results:
        sweep = results["sweep"]
        parts += ["", "## Sweep: best launch config per shape (the default is what paged_attention picks)", ""]
        for kind, key, unit in (("decode", "us", "us"), ("prefill", "ms", "ms")):
            rows = []
            for shape in dict.fromkeys(r["shape"] for r in sweep[kind]):
                mine = [r for r in sweep[kind] if r["shape"] == shape]
                top = min(mine, key=lambda r: r[key])
                default = next((r[key] for r in mine if r["is_default"]), float("nan"))
                splits = f" splits={top['num_splits']}" if kind == "decode" else ""
                rows.append([shape, default, top["tile"] + splits, top[key], default / top[key]])
            parts += [
                markdown_table([kind, f"default {unit}", "best config", f"best {unit}", "default / best"], rows),
                "",
                f"Single {kind} tiles over all its shapes (geometric-mean slowdown against each shape's best):",
                "",
                markdown_table(
                    ["tile", "slowdown"], [[r["tile"], r["slowdown_vs_best"]] for r in sweep[f"{kind}_best_tiles"]]
                ),
                "",
            ]
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for attention.json and attention.md")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs (a few more minutes)")
    parser.add_argument("--split-sweep", action="store_true", help="also time KV splits 1..8 at batch >= 32")
    parser.add_argument(
        "--tile-sweep", action="store_true", help="also time the plan against each decode tile, unsplit"
    )
    parser.add_argument("--graph-splits", action="store_true", help="also time batch 1-4 decode planned for 4k")
    parser.add_argument("--chain", action="store_true", help="also time batch 1-8 decode per layer of a step")
    parser.add_argument("--chain-batches", default=None, help="batch sizes --chain times, e.g. 1,8 (default: 1,2,4,8)")
    parser.add_argument("--chain-contexts", default=None, help="contexts --chain times, e.g. 1024,4096")
    parser.add_argument("--chain-splits", default=None, help="split counts --chain forces, e.g. 1,2,3")
    parser.add_argument(
        "--chain-default-only", action="store_true", help="--chain times the default plan and SDPA only"
    )
    parser.add_argument("--chain-match", default=None, help="--chain times the default and configs labelled with this")
    parser.add_argument("--only-mixed", action="store_true", help="skip the decode and prefill tables")
    parser.add_argument("--only-extra", action="store_true", help="only the tables asked for by other flags")
    parser.add_argument("--heads", type=int, default=HEADS, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="head size (the table is keyed by it)")
    parser.add_argument("--batches", default=None, help="comma-separated decode batch sizes (default: all)")
    parser.add_argument("--contexts", default=None, help="comma-separated decode contexts (default: all)")
    parser.add_argument(
        "--sweep-decode",
        default=None,
        help="decode shapes the sweep times, e.g. 1x1024,64x8192 (none: no decode shapes)",
    )
    parser.add_argument(
        "--sweep-prefill", default=None, help="prefill lengths the sweep times, e.g. 512,2048 (none: no prefill)"
    )
    parser.add_argument("--tiny", action="store_true", help="toy shapes: a smoke test that runs anywhere")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = bench_device(args.device)
    shapes = TINY if args.tiny else Shapes(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    if args.batches:
        shapes = dataclasses.replace(shapes, batches=tuple(int(b) for b in args.batches.split(",")))
    if args.contexts:
        shapes = dataclasses.replace(shapes, contexts=tuple(int(c) for c in args.contexts.split(",")))
    if args.sweep_decode:
        pairs = (
            ()
            if args.sweep_decode == "none"
            else tuple(tuple(int(v) for v in shape.split("x")) for shape in args.sweep_decode.split(","))
        )
        shapes = dataclasses.replace(shapes, sweep_decode=pairs)
    if args.chain_batches:
        shapes = dataclasses.replace(shapes, chain_batches=tuple(int(v) for v in args.chain_batches.split(",")))
    if args.chain_contexts:
        shapes = dataclasses.replace(shapes, chain_contexts=tuple(int(v) for v in args.chain_contexts.split(",")))
    if args.chain_splits:
        shapes = dataclasses.replace(shapes, chain_splits=tuple(int(v) for v in args.chain_splits.split(",")))
    if args.sweep_prefill:
        lengths = () if args.sweep_prefill == "none" else tuple(int(v) for v in args.sweep_prefill.split(","))
        shapes = dataclasses.replace(shapes, sweep_prefill=lengths)
    dtype = torch.bfloat16
    copy_bytes = 4 << 30 if device.type == "cuda" else 64 << 20
    log(f"device {device}; copy bandwidth ...")
    copy_gbs = clone_bandwidth_gbs(device, copy_bytes)
    log(f"copy bandwidth {copy_gbs:,.0f} GB/s")
    results = dict(
        environment=environment(device),
        dtype=str(dtype),
        shapes=f"{shapes.heads} query / {shapes.kv_heads} KV heads of {shapes.head_dim}, block {shapes.block}",
        copy_gbs=copy_gbs,
        copy_bytes=copy_bytes,
        decode=[] if args.only_mixed or args.only_extra else run_decode(shapes, dtype, device, copy_gbs),
        prefill=[] if args.only_mixed or args.only_extra else run_prefill(shapes, dtype, device),
    )
    results["mixed"] = [] if args.only_extra else run_mixed(shapes, dtype, device)
    if args.chain:
        results["chain"] = run_chain(
            shapes, dtype, device, copy_gbs, default_only=args.chain_default_only, match=args.chain_match
        )
        results["chain_fit"] = chain_fits(results["chain"], copy_gbs)
    if args.sweep:
        results["sweep"] = run_sweep(shapes, dtype, device, copy_gbs)
    if args.split_sweep:
        results["split_sweep"] = run_split_sweep(shapes, dtype, device, copy_gbs)
    if args.tile_sweep:
        results["tile_sweep"] = run_tile_sweep(shapes, dtype, device, copy_gbs)
    if args.graph_splits:
        results["graph_splits"] = run_graph_splits(shapes, dtype, device, copy_gbs)
    write_results(args.out, "attention", results, render(results))


if __name__ == "__main__":
    main()
