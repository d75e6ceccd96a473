"""Split-KV (flash-decoding) paged attention: the split path, its merge kernel, and the launch heuristics."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, DTYPES, assert_close, dtypes, randn, seeds
from tests.kernels.test_paged_attention import (
    block_sizes,
    make_batch,
    plan,
    reference,
    run,
    scheduled_rows,
    targets,
    windows,
)
from tritonllm.kernels.arrival_counters import _COUNTERS
from tritonllm.kernels.paged_attention_config import (
    _FEW_PROGRAMS_SPLITS,
    _MAX_SPLITS,
    _MIN_WAVES,
    _SPLIT_BELOW_BUSY,
    _SPLIT_MIN_TILES,
    HOPPER_H100,
    HOPPER_H200,
    AttentionTarget,
    PagedAttentionConfig,
    choose_num_splits,
    current_target,
    decode_tiles,
    paged_attention_config,
)
from tritonllm.kernels.paged_attention_split import merge_attention_partials, merge_attention_partials_ref

# (num_kv_heads, queries per kv head), kept small: the GPU plan launches num_seqs x Hk x num_splits programs.
small_layouts = st.sampled_from([(1, 1), (2, 2), (1, 5), (2, 4)])


@st.composite
def decode_batches(draw, max_seqs: int = 3, max_context: int = 200) -> list[tuple[int, int]]:
    """(context_len, query_len): a long decode first, then decode, idle, a sequence shorter than one split, and a
    short chunk that still fits one query tile."""
    seqs = [(draw(st.integers(max_context // 4, max_context)), 1)]
    for _ in range(draw(st.integers(0, max_seqs - 1))):
        kind = draw(st.sampled_from(["decode", "decode", "decode", "short", "idle", "chunk"]))
        if kind == "decode":
            seqs.append((draw(st.integers(0, max_context)), 1))
        elif kind == "short":  # a sequence shorter than one split: its later splits are empty
            seqs.append((draw(st.integers(0, 3)), 1))
        elif kind == "idle":
            seqs.append((draw(st.integers(1, 20)), 0))
        else:
            seqs.append((draw(st.integers(0, max_context)), 2))
    return seqs


@settings(max_examples=6)
@given(
    seqs=decode_batches(),
    layout=small_layouts,
    head_size=st.sampled_from([64, 80, 128]),
    block_size=block_sizes,
    window=windows,
    num_splits=st.sampled_from([2, 3, 5, 8]),
    split_min_tiles=st.sampled_from([1, 1, 2, 3]),
    short_tiles=st.booleans(),
    merge_in_launch=st.booleans(),
    dtype=dtypes,
    target=targets,
    seed=seeds(),
)
def test_forced_split_matches_reference(
    seqs, layout, head_size, block_size, window, num_splits, split_min_tiles, short_tiles, merge_in_launch, dtype,
    target, seed,
):  # fmt: skip
    b = make_batch(seqs, *layout, head_size, block_size, dtype, seed)
    cfg = plan(b, target or current_target(), window, num_splits)
    assert cfg.num_splits == num_splits  # every sequence fits one query tile: the split path runs
    cfg = dataclasses.replace(cfg, merge_in_launch=merge_in_launch, split_min_tiles=split_min_tiles)
    if short_tiles:  # many KV tiles per sequence, rarely a multiple of the split count
        cfg = dataclasses.replace(cfg, tile_n=16)

    def call():
        return run(b, window, config=cfg)

    out = call()
    assert_close(out, reference(b, window), dtype=dtype)
    # The in-launch merge leaves its arrival counters at zero, so the next launch merges exactly once again.
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())
    assert torch.equal(call(), out)


@settings(max_examples=6)
@given(
    num_splits=st.sampled_from([5, 8, 13]),
    chunk=st.sampled_from([1, 2, 4]),
    extra=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    layout=small_layouts,
    dtype=dtypes,
    target=targets,
    seed=seeds(),
)
def test_in_launch_merge_over_more_splits_than_one_read(num_splits, chunk, extra, layout, dtype, target, seed):
    # Every split holds keys (16-key tiles, at least one per split), and there are more splits than the in-launch
    # merge reads at a time: both merges must weigh every split.
    b = make_batch([(16 * num_splits + e, 1) for e in extra], *layout, 64, 16, dtype, seed)
    cfg = dataclasses.replace(plan(b, target or current_target(), None, num_splits), tile_n=16, merge_chunk=chunk)
    outs = [run(b, config=dataclasses.replace(cfg, merge_in_launch=fused)) for fused in (True, False)]
    assert_close(outs[0], reference(b), dtype=dtype)
    assert_close(outs[0], outs[1], dtype=dtype)


@settings(max_examples=6)
@given(
    query_lens=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    layout=st.sampled_from([(2, 4), (1, 5), (1, 2), (2, 1)]),
    num_splits=st.sampled_from([2, 3, 8]),
    dtype=dtypes,
    seed=seeds(),
)
def test_in_launch_merge_of_tiles_with_several_tokens(query_lens, layout, num_splits, dtype, seed):
    # Speculative decode: a tile holds up to block_q tokens' GQA groups (5 heads: groups that are not a power of
    # two), all merged by the tile's last split program.
    b = make_batch([(60 + 7 * i, q) for i, q in enumerate(query_lens)], *layout, 64, 16, dtype, seed)
    cfg = dataclasses.replace(plan(b, HOPPER_H200, None, num_splits), tile_n=16, merge_in_launch=True)
    assert cfg.block_q >= max(query_lens) and cfg.num_splits == num_splits
    out = run(b, config=cfg)
    assert_close(out, reference(b), dtype=dtype)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


@settings(max_examples=6)
@given(
    tiles=st.integers(1, 12),
    split_min_tiles=st.integers(2, 5),
    merge_in_launch=st.booleans(),
    layout=small_layouts,
    dtype=dtypes,
    target=targets,
    seed=seeds(),
)
def test_sequences_shorter_than_the_minimum_split_use_fewer_splits(
    tiles, split_min_tiles, merge_in_launch, layout, dtype, target, seed
):
    # 8 splits planned, but each split must walk split_min_tiles 16-key tiles: a sequence of `tiles` tiles uses
    # ceil(tiles / split_min_tiles) of them or fewer; both merges weigh exactly the splits that hold keys.
    b = make_batch([(16 * tiles - 1, 1), (16 * (tiles + 3), 1)], *layout, 64, 16, dtype, seed)
    cfg = dataclasses.replace(
        plan(b, target or current_target(), None, 8), tile_n=16, split_min_tiles=split_min_tiles,
        merge_in_launch=merge_in_launch,
    )  # fmt: skip
    out = run(b, config=cfg)
    assert_close(out, reference(b), dtype=dtype)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=3)
@given(
    seqs=decode_batches(max_seqs=2, max_context=150),
    max_model_len=st.sampled_from([1024, 2048]),
    block_size=block_sizes,
    window=windows,
    seed=seeds(),
)
def test_split_chosen_for_small_batches_with_long_max_seq_len(seqs, max_model_len, block_size, window, dtype, seed):
    # A CUDA graph captured at max_seq_len = max_model_len replays for sequences far shorter: the split count comes
    # from the ints alone, and each sequence cuts its own (short) range, leaving most splits empty.
    b = make_batch(seqs, 2, 4, 128, block_size, dtype, seed)
    cfg = plan(b, HOPPER_H200, window, max_seq_len=max_model_len)
    assert cfg.num_splits > 1
    out = run(b, window, target=HOPPER_H200, max_seq_len=max_model_len)
    assert_close(out, reference(b, window), dtype=dtype)


@settings(max_examples=4)
@given(
    context=st.integers(0, 40),
    extra=st.integers(1, 40),
    num_splits=st.sampled_from([2, 4]),
    dtype=dtypes,
    target=targets,
    seed=seeds(),
)
def test_long_queries_fall_back_to_one_split(context, extra, num_splits, dtype, target, seed):
    # A sequence with more queries than one tile holds runs unsplit whatever num_splits asks for.
    on = target or current_target()
    most = dict(num_seqs=2, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype, max_seq_len=1 << 20, target=on)
    tile_tokens = paged_attention_config(max_query_len=1 << 20, **most).block_q
    b = make_batch([(context, tile_tokens + extra), (30, 1)], 2, 4, 64, 16, dtype, seed)
    assert b.max_query_len > plan(b, on).block_q
    assert plan(b, on, num_splits=num_splits).num_splits == 1
    out = run(b, target=target, num_splits=num_splits)
    assert torch.equal(out, run(b, target=target, num_splits=1))
    assert_close(out, reference(b), dtype=dtype)
    forced = PagedAttentionConfig(
        block_m=16, block_q=4, tile_n=32, kv_heads_per_program=1, num_warps=4, num_stages=2, num_splits=2
    )
    with pytest.raises(ValueError, match="one query tile"):
        run(b, config=forced)


@given(seqs=decode_batches(max_seqs=2), dtype=dtypes, num_splits=st.sampled_from([2, 3]), target=targets, seed=seeds())
def test_split_leaves_rows_past_the_batch_untouched(seqs, dtype, num_splits, target, seed):
    b = make_batch(seqs, 1, 3, 80, 16, dtype, seed)
    buf = randn(b.q.shape[0] + 3, b.q.shape[1], b.q.shape[2], dtype=dtype, seed=seed + 9)
    before = buf.clone()
    out = buf[1:]  # the last two rows are padding past query_start_loc[-1] (a graph's fixed batch size)
    b.q = torch.cat([b.q, randn(2, *b.q.shape[1:], dtype=dtype, seed=seed + 5)])
    assert run(b, out=out, target=target, num_splits=num_splits) is out
    rows = scheduled_rows(b)
    assert_close(out[rows], reference(b)[rows], dtype=dtype)
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[-2:], before[-2:])


@given(
    num_tokens=st.sampled_from([1, 2, 7]),
    num_heads=st.sampled_from([1, 3, 8]),
    num_splits=st.sampled_from([1, 2, 5, 16]),
    head_size=st.sampled_from([5, 64, 123]),
    heads_per_program=st.sampled_from([1, 2, 8]),
    dtype=dtypes,
    seed=seeds(),
)
def test_merge_matches_reference(num_tokens, num_heads, num_splits, head_size, heads_per_program, dtype, seed):
    part_out = randn(num_tokens, num_heads, num_splits, head_size, dtype=torch.float32, seed=seed)
    part_lse = randn(num_tokens, num_heads, num_splits, dtype=torch.float32, seed=seed + 1, scale=4.0)
    g = torch.Generator().manual_seed(seed + 2)
    empty = torch.rand(num_tokens, num_heads, num_splits, generator=g).to(DEVICE) < 0.3
    part_lse[empty] = float("-inf")  # empty splits
    part_lse[0, 0] = float("-inf")  # a row with no visible key at all
    out = torch.empty(num_tokens, num_heads, head_size, dtype=dtype, device=DEVICE)
    merge_attention_partials(part_out, part_lse, out, heads_per_program=heads_per_program)
    expected = merge_attention_partials_ref(part_out, part_lse)
    assert torch.equal(expected[0, 0], torch.zeros_like(expected[0, 0]))
    assert_close(out, expected, dtype=dtype)


@given(
    num_programs=st.integers(1, 4096),
    num_sms=st.sampled_from([1, 4, 78, 132, 148]),
    max_seq_len=st.integers(1, 1 << 17),
    tile_n=st.sampled_from([16, 32, 64, 128]),
    chunk=st.sampled_from([1, 4, 8, 16]),
    per_sm=st.integers(1, 6),
)
def test_num_splits_heuristic(num_programs, num_sms, max_seq_len, tile_n, chunk, per_sm):
    n = choose_num_splits(num_programs, num_sms, max_seq_len, tile_n, chunk, programs_per_sm=per_sm)
    assert 1 <= n <= _MAX_SPLITS
    resident = per_sm * num_sms
    # Longer contexts never ask for fewer splits.
    assert choose_num_splits(num_programs, num_sms, 2 * max_seq_len, tile_n, chunk, programs_per_sm=per_sm) >= n
    # A grid short of a program per SM that already keeps most of the bandwidth busy unsplit stays unsplit.
    busy = choose_num_splits(
        num_programs, num_sms, max_seq_len, tile_n, chunk, programs_per_sm=per_sm, unsplit_busy=_SPLIT_BELOW_BUSY
    )
    few = num_programs * _FEW_PROGRAMS_SPLITS <= resident
    assert busy == (1 if num_programs < num_sms and not few else n)
    if few:
        # So few programs that the fixed split count fits in one wave: that count, as far as the length allows.
        assert n == max(1, min(_FEW_PROGRAMS_SPLITS, max_seq_len // (tile_n * _SPLIT_MIN_TILES)))
        return
    if num_sms <= num_programs <= resident or num_programs >= _MIN_WAVES * resident:
        assert n == 1  # one wave that fills the GPU, or enough waves that the last one matters little
    # What the grid asks for: 2 programs per SM, or past _MIN_WAVES waves of resident programs.
    wanted = 2 * num_sms if num_programs < num_sms else _MIN_WAVES * resident
    if n > 1:
        assert n * tile_n * _SPLIT_MIN_TILES <= max_seq_len  # every split of the longest sequence gets its tiles
        assert num_programs * (n - 1) < wanted  # no more splits than it takes to get there
    if n > chunk:
        assert n % chunk == 0  # whole merge chunks
    room = min(max_seq_len // (tile_n * _SPLIT_MIN_TILES), _MAX_SPLITS)  # splits the length allows
    if n + (chunk if n >= chunk else 1) <= room and (n > 1 or num_programs < num_sms):
        # Not held back by the length: there, one split short of it where that spreads more evenly over the SMs,
        # or one merge chunk short of it.
        assert num_programs * (n + 1 + (chunk - 1 if n >= chunk else 0)) >= wanted
    if 1 < n < chunk and num_programs < num_sms and n < max_seq_len // (tile_n * _SPLIT_MIN_TILES):
        # Of the split counts on either side of two programs per SM, the one whose programs spread more evenly.
        def most_per_sm(splits):  # the SM that finishes last holds this many programs (per program of work)
            return -(-num_programs * splits // num_sms) / splits

        other = n - 1 if num_programs * n >= wanted else n + 1
        assert most_per_sm(n) <= most_per_sm(other)
        assert most_per_sm(n) < most_per_sm(other) or n < other  # ties to fewer splits


# (target, batch, KV tile, splits) for Llama-3 8B's attention (32 / 8 heads of 128, 8 programs a sequence) decoding
# 4k contexts on 132 SMs. H100 rows: the fastest of the 16-, 32- and 64-key tiles and of splitting where measured
# (docs/benchmarks.md); H200 rows: measured at batch 32, 40, 64 and 72, the rest what the rule predicts from the
# bandwidth.
FULL_GRID_TILES = [
    (HOPPER_H100, 1, 64, 16),  # 8 programs: 16 splits (one wave), the tile batch 1 was tuned with
    (HOPPER_H100, 3, 64, 16),  # 24 programs x 16 = 384: still within a wave of 3 per SM
    (HOPPER_H100, 4, 32, 8),  # 32 programs x 8 splits: 1.94 per SM, the 32-key tile as for an unsplit batch 32
    (HOPPER_H100, 8, 32, 4),  # 64 programs: 4 splits spread evenly (1.94 per SM); 5 would leave SMs with 3 and 2
    (HOPPER_H200, 8, 64, 4),  # the same grid at 4.8 TB/s: too few reads in flight for the 32-key tile
    (HOPPER_H100, 12, 64, 2),  # 96 programs, 0.73 of the SMs busy unsplit: 2 splits (3 spread no more evenly)
    (HOPPER_H100, 13, 64, 1),  # 104 programs, 0.79: the idle SMs give back less than a split costs
    (HOPPER_H100, 16, 64, 1),
    (HOPPER_H200, 12, 64, 2),  # 96 programs, each reading a little too little at 4.8 TB/s to keep its SM busy: 0.69
    (HOPPER_H200, 14, 64, 1),  # 112 programs: 0.80
    (HOPPER_H100, 26, 64, 1),  # 1.58 programs per SM: too few reads in flight for 32-key tiles
    (HOPPER_H100, 28, 32, 1),  # 1.70: enough on this GPU
    (HOPPER_H100, 32, 32, 1),
    (HOPPER_H100, 49, 32, 1),  # 2.97: too few for 16-key tiles
    (HOPPER_H100, 50, 16, 1),  # 3.03: enough
    (HOPPER_H100, 56, 16, 1),  # 3.4-7.8: one wave of the 8-per-SM 16-key tile
    (HOPPER_H100, 64, 16, 1),
    (HOPPER_H100, 128, 16, 1),
    (HOPPER_H100, 160, 32, 1),  # 1280 programs: 1.2 waves of 16-key tiles, 2.4 of 32-key, 3.2 of 64-key ones (tie)
    (HOPPER_H100, 192, 32, 1),  # 1536: 1.45 waves of 16-key tiles; 2.9 of 32-key and 3.9 of 64-key ones tie
    (HOPPER_H100, 224, 64, 1),  # 1792: 4.5 waves of 64-key tiles, the fullest last wave
    (HOPPER_H100, 256, 16, 1),  # 2048: 1.94 waves of 16-key tiles, 3.9 of 32-key ones: a tie to the more resident
    (HOPPER_H200, 32, 64, 1),  # 1.9 programs per SM: too few reads in flight for 32-key tiles at 4.8 TB/s
    (HOPPER_H200, 38, 64, 1),  # 2.3: still too few
    (HOPPER_H200, 40, 32, 1),  # 2.4: enough (measured even with the 64-key tile)
    (HOPPER_H200, 64, 32, 1),  # 3.9: enough for 32-key tiles, one wave of them; too few for 16-key ones
    (HOPPER_H200, 71, 64, 1),  # 4.3: still too few for 16-key tiles; 1.1 waves of 32-key ones, 1.4 of 64-key ones
    (HOPPER_H200, 72, 16, 1),  # 4.36 and up: 16-key tiles
    (HOPPER_H200, 80, 16, 1),
    (HOPPER_H200, 128, 16, 1),
]


@pytest.mark.parametrize("target, num_seqs, tile_n, num_splits", FULL_GRID_TILES)
def test_full_grid_decode_tiles(target, num_seqs, tile_n, num_splits):
    cfg = paged_attention_config(
        num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
        max_query_len=1, max_seq_len=4096, target=target,
    )  # fmt: skip
    assert (cfg.tile_n, cfg.num_splits) == (tile_n, num_splits)
    assert cfg.num_warps == (2 if tile_n == 16 else 4)
    # Batch 1-3 merge in a launch of their own; larger split grids merge in the attention launch.
    assert cfg.num_splits == 1 or cfg.merge_in_launch == (num_seqs > 3)


@pytest.mark.parametrize("target", [HOPPER_H100, HOPPER_H200])
def test_grids_of_one_to_two_waves_split_without_a_narrower_tile(target):
    # Head 64 has one decode tile (3 resident a SM): 480 programs are 1.2 waves of it, so they split until the last
    # wave is nearly full, however busy so many programs keep the GPU.
    cfg = paged_attention_config(
        num_seqs=60, num_heads=32, num_kv_heads=8, head_size=64, dtype=torch.bfloat16,
        max_query_len=1, max_seq_len=4096, target=target,
    )  # fmt: skip
    assert cfg.num_splits == math.ceil(_MIN_WAVES * 3 * target.num_sms / 480) == 2


@pytest.mark.parametrize("target", [HOPPER_H100, HOPPER_H200])
@pytest.mark.parametrize("max_seq_len", [1024, 4096, 32768])
def test_larger_decode_batches_never_split_more(target, max_seq_len):
    # More sequences keep more SMs busy unsplit, so a larger batch never splits its KV more ways; past the few
    # programs of batch 1-3 the split count comes down to 1 before the grid has a program per SM.
    splits = [
        paged_attention_config(
            num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
            max_query_len=1, max_seq_len=max_seq_len, target=target,
        ).num_splits
        for num_seqs in range(4, 40)
    ]  # fmt: skip
    assert splits == sorted(splits, reverse=True)
    assert splits[0] > 1 and splits[-1] == 1
    assert splits[(target.num_sms // 8) - 4] == 1  # batch 16: 128 programs on 132 SMs


@pytest.mark.parametrize("target", [HOPPER_H100, HOPPER_H200])
def test_decode_plans_use_the_tables_decode_tiles(target):
    # What benchmarks force (decode_tiles) is what plans pick from: every decode plan runs one of those tiles.
    tiles = decode_tiles(128, torch.bfloat16)
    assert set(tiles) == {"decode", "decode_full_grid", "decode_crowded"}
    picked = set()
    for num_seqs in range(1, 300, 7):
        cfg = paged_attention_config(
            num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
            max_query_len=1, max_seq_len=2048, target=target,
        )  # fmt: skip
        picked.add((cfg.tile_n, cfg.num_warps, cfg.num_stages))
    assert picked == set(tiles.values())
    assert decode_tiles(64, torch.float32) == {"decode": (32, 8, 2)}


def test_faster_memory_needs_more_programs_per_sm_for_narrower_tiles():
    # Whatever the batch, a GPU with more bandwidth per SM never gets a narrower decode tile than a slower one.
    for num_seqs in range(17, 400):
        tiles = [
            paged_attention_config(
                num_seqs=num_seqs, num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.float16,
                max_query_len=1, max_seq_len=1024, target=AttentionTarget(interpret=False, num_sms=132, dram_gbs=gbs),
            ).tile_n
            for gbs in (2000.0, 3352.3, 4800.0, 8000.0)
        ]  # fmt: skip
        single_wave = num_seqs * 8 <= 8 * 132
        if single_wave:
            assert tiles == sorted(tiles), (num_seqs, tiles)


@given(
    head_size=st.sampled_from([32, 64, 80, 96, 128, 256]),
    dtype=dtypes,
    layout=st.sampled_from([(8, 4), (8, 1), (1, 32), (4, 2), (2, 5)]),
    max_query_len=st.sampled_from([1, 2, 4, 16, 123, 1151]),
    max_seq_len=st.sampled_from([5, 123, 1151, 32768]),
    num_seqs=st.sampled_from([1, 8, 64, 256]),
    interpret=st.booleans(),
)
def test_launch_plans_are_consistent(head_size, dtype, layout, max_query_len, max_seq_len, num_seqs, interpret):
    num_kv_heads, queries_per_kv = layout
    target = AttentionTarget(interpret=True, num_sms=1) if interpret else HOPPER_H200
    cfg = paged_attention_config(
        num_seqs=num_seqs,
        num_heads=num_kv_heads * queries_per_kv,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        target=target,
    )
    pow2 = lambda x: x & (x - 1) == 0
    assert pow2(cfg.block_m) and pow2(cfg.tile_n) and cfg.tile_n >= 16
    assert 1 <= cfg.block_q and cfg.block_q * cfg.kv_heads_per_program * queries_per_kv <= cfg.block_m
    assert cfg.num_splits == 1 or max_query_len <= cfg.block_q
    if interpret:
        assert cfg.num_splits == 1  # programs run in turn there: splitting only adds programs
        cols = triton_next_pow2(cfg.kv_heads_per_program) * triton_next_pow2(head_size)
        assert max(cfg.block_m, cfg.tile_n) * max(cfg.tile_n, cols) <= 2**20  # Triton's largest tile
        if num_kv_heads * triton_next_pow2(head_size) <= 1024:
            assert cfg.kv_heads_per_program == num_kv_heads  # one program covers every head of a query tile
        if max_query_len <= 8:
            assert cfg.block_q >= max_query_len  # decode: one program per sequence
    else:
        assert cfg.kv_heads_per_program == 1 and cfg.block_m >= 16
        # K and V tiles per pipeline stage plus the Q tile fit Hopper's 227 KiB of shared memory.
        elem = torch.finfo(dtype).bits // 8
        hp = triton_next_pow2(head_size)
        assert (cfg.num_stages * 2 * cfg.tile_n + cfg.block_m) * hp * elem <= 227 * 1024
        if num_seqs * num_kv_heads < HOPPER_H200.num_sms and max_seq_len >= 4096 and max_query_len == 1:
            assert cfg.num_splits > 1  # a small decode batch with long contexts gets split-KV on its own


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()
