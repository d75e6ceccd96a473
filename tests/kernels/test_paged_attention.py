import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import DEVICE, DTYPES, assert_close, dtypes, randn, seeds
from tritonllm.kernels.paged_attention import paged_attention, paged_attention_ref
from tritonllm.kernels.paged_attention_config import (
    HOPPER_H200,
    AttentionTarget,
    PagedAttentionConfig,
    current_target,
    paged_attention_config,
)

HEAD_SIZES = [64, 80, 96, 128, 256]
block_sizes = st.sampled_from([8, 16, 32])
# (num_kv_heads, queries per kv head): MHA, GQA with power-of-two and odd groups, MQA.
head_layouts = st.sampled_from([(2, 1), (2, 2), (1, 3), (2, 4), (1, 8), (1, 5)])
windows = st.one_of(st.none(), st.integers(min_value=1, max_value=40))
# Launch plans: None is this machine's own (one program per query tile over all KV heads, long KV tiles under the
# interpreter); HOPPER_H200 is the GPU table (one KV head per program, 32-128 wide KV tiles, split-KV by SM count).
targets = st.sampled_from([None, HOPPER_H200])


@st.composite
def sequences(draw, max_seqs: int = 4) -> list[tuple[int, int]]:
    """(context_len, query_len) per sequence: decode, full prefill, prefill over a cached prefix, or idle."""
    seqs = []
    for _ in range(draw(st.integers(min_value=1, max_value=max_seqs))):
        kind = draw(st.sampled_from(["decode", "prefill", "prefix", "decode", "prefill", "prefix", "idle"]))
        if kind == "decode":
            seqs.append((draw(st.integers(0, 70)), 1))
        elif kind == "prefill":
            seqs.append((0, draw(st.integers(1, 40))))
        elif kind == "prefix":
            seqs.append((draw(st.integers(1, 50)), draw(st.integers(2, 24))))
        else:
            seqs.append((draw(st.integers(1, 20)), 0))  # no tokens scheduled this step
    return seqs


@dataclass(slots=True)
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    scale: float


def make_batch(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    queries_per_kv: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    fused_q: bool = False,
    spare_blocks: int = 3,
    first_block: int = 0,
    num_blocks: int | None = None,
) -> Batch:
    """Random queries and a random cache; each sequence owns random distinct physical blocks.

    Physical ids are drawn from [first_block, first_block + needed + spare_blocks); the cache has `num_blocks`
    blocks (just enough by default). Block-table padding points at other sequences' blocks, so reading it
    would show up as a wrong answer.
    """
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * queries_per_kv
    seq_lens = [c + q for c, q in seqs]
    query_lens = [q for _, q in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    used = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(used, generator=g) + first_block
    max_blocks = max(blocks_per_seq) + 1
    table = physical[torch.randint(0, used, (len(seqs), max_blocks), generator=g)]  # padding: blocks in use
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = physical[taken : taken + n]
        taken += n

    num_blocks = num_blocks or first_block + used
    if first_block == 0:
        k_cache = randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + 1)
        v_cache = randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + 2)
    else:  # a sparse cache: only the blocks in use get pages
        k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=DEVICE)
        v_cache = torch.empty_like(k_cache)
        k_cache[first_block:] = randn(used, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + 1)
        v_cache[first_block:] = randn(used, block_size, num_kv_heads, head_size, dtype=dtype, seed=seed + 2)

    num_tokens = sum(query_lens)
    if fused_q:
        width = (num_heads + 2 * num_kv_heads) * head_size
        q = randn(num_tokens, width, dtype=dtype, seed=seed + 3)[:, : num_heads * head_size]
        q = q.view(num_tokens, num_heads, head_size)
    else:
        q = randn(num_tokens, num_heads, head_size, dtype=dtype, seed=seed + 3)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return Batch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=torch.tensor(starts, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=table.to(**i32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        scale=head_size**-0.5,
    )


def plan(
    b: Batch,
    target: AttentionTarget | None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
):
    return paged_attention_config(
        num_seqs=b.seq_lens.shape[0],
        num_heads=b.q.shape[1],
        num_kv_heads=b.k_cache.shape[2],
        head_size=b.q.shape[2],
        dtype=b.q.dtype,
        max_query_len=b.max_query_len,
        max_seq_len=max_seq_len or b.max_seq_len,
        sliding_window=sliding_window,
        num_splits=num_splits,
        target=target,
    )


def run(
    b: Batch,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    target: AttentionTarget | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    config: PagedAttentionConfig | None = None,
) -> torch.Tensor:
    """paged_attention over the batch: with `config` as given, else planned for `target` (None: its own plan)."""
    if config is None and target is not None:
        config = plan(b, target, sliding_window, num_splits, max_seq_len)
    return paged_attention(
        b.q,
        b.k_cache,
        b.v_cache,
        b.query_start_loc,
        b.seq_lens,
        b.block_tables,
        b.max_query_len,
        max_seq_len or b.max_seq_len,
        b.scale,
        sliding_window=sliding_window,
        out=out,
        num_splits=num_splits,
        config=config,
    )


def reference(b: Batch, sliding_window: int | None = None) -> torch.Tensor:
    return paged_attention_ref(
        b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, b.scale, sliding_window
    )


def scheduled_rows(b: Batch) -> torch.Tensor:
    return torch.arange(b.q.shape[0], device=DEVICE) < b.query_start_loc[-1]


# Every (dtype, head size) pair gets its own examples; the rest of the batch is drawn.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@settings(max_examples=max(2, settings.default.max_examples // 4))
@given(
    seqs=sequences(),
    layout=head_layouts,
    block_size=block_sizes,
    window=windows,
    fused_q=st.booleans(),
    target=targets,
    seed=seeds(),
)
def test_matches_reference(seqs, layout, head_size, block_size, window, dtype, fused_q, target, seed):
    b = make_batch(seqs, *layout, head_size, block_size, dtype, seed, fused_q=fused_q)
    out = run(b, window, target=target)
    assert out.shape == b.q.shape and out.dtype == dtype
    assert_close(out, reference(b, window), dtype=dtype)


@given(
    seqs=sequences(),
    layout=head_layouts,
    block_size=block_sizes,
    window=windows,
    dtype=dtypes,
    target=targets,
    seed=seeds(),
)
def test_block_permutation_changes_nothing(seqs, layout, block_size, window, dtype, target, seed):
    b = make_batch(seqs, *layout, 64, block_size, dtype, seed, spare_blocks=5)
    expected = run(b, window, target=target)
    g = torch.Generator().manual_seed(seed + 7)
    perm = torch.randperm(b.k_cache.shape[0], generator=g).to(DEVICE)  # old physical id -> new
    k_moved, v_moved = torch.empty_like(b.k_cache), torch.empty_like(b.v_cache)
    k_moved[perm], v_moved[perm] = b.k_cache, b.v_cache
    b.k_cache, b.v_cache = k_moved, v_moved
    b.block_tables = perm[b.block_tables.long()].to(torch.int32)
    # Same values visited in the same order: bit-identical.
    assert torch.equal(run(b, window, target=target), expected)


@given(
    block_size=block_sizes,
    blocks=st.integers(min_value=1, max_value=3),
    delta=st.sampled_from([-1, 0, 1]),
    layout=head_layouts,
    dtype=dtypes,
    target=targets,
    seed=seeds(),
)
def test_sequences_crossing_block_boundaries(block_size, blocks, delta, layout, dtype, target, seed):
    edge = blocks * block_size
    # Decode just before/at/after a boundary, a prefill ending there, and a chunk straddling it.
    seqs = [(edge + delta - 1, 1), (0, edge + delta), (edge - 2, 4 + delta)]
    b = make_batch(seqs, *layout, 64, block_size, dtype, seed)
    assert_close(run(b, target=target), reference(b), dtype=dtype)


@given(
    contexts=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    chunk=st.tuples(st.integers(0, 30), st.integers(2, 30)),
    at=st.integers(0, 4),
    bound=st.sampled_from([0, 7, 64]),
    layout=head_layouts,
    window=windows,
    dtype=dtypes,
    target=targets,
    seed=seeds(),
)
def test_mixed_step_with_a_launch_for_short_queries(contexts, chunk, at, bound, layout, window, dtype, target, seed):
    # Decodes next to a prefill chunk, planned for a host-side max_query_len above the true one (a mixed-step CUDA
    # graph plans for its token bucket): the decodes run in a launch of their own, the chunk in the prefill one.
    seqs = [(c, 1) for c in contexts]
    seqs.insert(at % (len(seqs) + 1), chunk)
    b = make_batch(seqs, *layout, 64, 16, dtype, seed)
    b.max_query_len += bound
    config = plan(b, target, window)
    if (target or current_target()).interpret:  # the interpreter plans a single launch; give it the GPU's pair
        short = plan(dataclasses.replace(b, max_query_len=1), target, window)
        config = dataclasses.replace(config, short_queries=short)
    # The GPU plan adds the short launch whenever the prefill-shaped tile could hold a decode.
    assert config.short_queries is not None or b.max_query_len <= config.block_q
    assert_close(run(b, window, config=config), reference(b, window), dtype=dtype)


@given(seqs=sequences(max_seqs=2), block_size=block_sizes, dtype=dtypes, target=targets, seed=seeds())
def test_window_edges(seqs, block_size, dtype, target, seed):
    b = make_batch(seqs, 2, 2, 64, block_size, dtype, seed)
    rows = scheduled_rows(b)
    # A window covering the whole context is no window at all (the interpreter plans different tiles for it).
    if target is not None:
        assert torch.equal(run(b, b.max_seq_len, target=target)[rows], run(b, target=target)[rows])
    else:
        assert_close(run(b, b.max_seq_len)[rows], run(b)[rows], dtype=dtype)
    # A window of one: each query sees only its own key, so the output is its own value.
    out = run(b, 1, target=target)
    expected = torch.empty_like(out)
    starts = b.query_start_loc.tolist()
    bs = block_size
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        for t in range(starts[i], starts[i + 1]):
            pos = seq_len - (starts[i + 1] - t)
            kv = b.v_cache[b.block_tables[i, pos // bs], pos % bs]  # [Hk, D]
            expected[t] = kv.repeat_interleave(2, dim=0)
    assert_close(out[rows], expected[rows], dtype=dtype)


@given(
    window=st.integers(min_value=1, max_value=40),
    tiles=st.sampled_from([1, 2]),
    delta=st.sampled_from([-1, 0]),
    query_len=st.sampled_from([1, 5]),
    block_size=block_sizes,
    dtype=dtypes,
    seed=seeds(),
)
def test_window_starting_at_a_kv_tile_edge(window, tiles, delta, query_len, block_size, dtype, seed):
    # Put the first query's oldest visible key exactly on (or one before) an edge of the GPU plan's KV tiles,
    # where skipping whole tiles before the window is easiest to get wrong.
    tile_n = paged_attention_config(
        num_seqs=2,
        num_heads=4,
        num_kv_heads=1,
        head_size=64,
        dtype=dtype,
        max_query_len=query_len,
        max_seq_len=1,
        num_splits=1,
        target=HOPPER_H200,
    ).tile_n
    context_len = tile_n * tiles + window - 1 + delta
    b = make_batch([(context_len, query_len), (context_len + 3, 1)], 1, 4, 64, block_size, dtype, seed)
    assert_close(run(b, window, target=HOPPER_H200, num_splits=1), reference(b, window), dtype=dtype)


@given(seqs=sequences(max_seqs=2), dtype=dtypes, seed=seeds())
def test_writes_into_given_out(seqs, dtype, seed):
    b = make_batch(seqs, 1, 3, 80, 16, dtype, seed)
    buf = randn(b.q.shape[0] + 2, b.q.shape[1], b.q.shape[2], dtype=dtype, seed=seed + 9)
    before = buf.clone()
    out = buf[1:-1]
    assert run(b, out=out) is out
    rows = scheduled_rows(b)
    assert_close(out[rows], reference(b)[rows], dtype=dtype)
    assert torch.equal(buf[0], before[0]) and torch.equal(buf[-1], before[-1])


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@settings(max_examples=3)
@given(seqs=sequences(max_seqs=2), window=windows, dtype=dtypes, num_splits=st.sampled_from([None, 2]), seed=seeds())
def test_offsets_past_int32(seqs, window, dtype, num_splits, seed):
    # A cache of more than 2^31 elements whose used blocks sit at its very end: block_id * stride_block passes
    # 2^31, so 32-bit offsets would read the wrong memory. On the CPU only the touched pages get committed.
    block_size, num_kv_heads, head_size = 16, 2, 64
    num_blocks = 2**31 // (block_size * num_kv_heads * head_size) + 64
    needed = sum(-(-(c + q) // block_size) for c, q in seqs) + 3
    before = _resident_mib()
    b = make_batch(
        seqs,
        num_kv_heads,
        2,
        head_size,
        block_size,
        dtype,
        seed,
        first_block=num_blocks - needed,
        num_blocks=num_blocks,
    )
    assert b.k_cache.numel() > 2**31 and b.block_tables.min() * b.k_cache.stride(0) >= 2**31
    assert_close(run(b, window, num_splits=num_splits), reference(b, window), dtype=dtype)
    if DEVICE.type == "cpu":
        assert _resident_mib() - before < 256, "the sparse cache got committed; the test would need real memory"


def test_rejects_bad_inputs():
    b = make_batch([(3, 2)], 2, 2, 64, 16, torch.float16, 0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(b.q[:, :3], b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, 2, 5, 1.0)
    with pytest.raises(ValueError, match="same one of"):
        paged_attention(b.q.float(), b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, 2, 5, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        qsl = b.query_start_loc.long()
        paged_attention(b.q, b.k_cache, b.v_cache, qsl, b.seq_lens, b.block_tables, 2, 5, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        run(b, sliding_window=0)


def test_rejects_configs_that_cannot_run_the_batch():
    b = make_batch([(3, 1), (0, 40)], 2, 2, 64, 16, torch.float16, 0)
    good = plan(b, HOPPER_H200)
    assert good.short_queries is not None

    def call(config):
        return run(b, config=config)

    assert_close(call(good), reference(b), dtype=torch.float16)
    with pytest.raises(ValueError, match="powers of two"):
        call(dataclasses.replace(good, tile_n=48))
    with pytest.raises(ValueError, match="kv_heads_per_program"):
        call(dataclasses.replace(good, kv_heads_per_program=3))
    with pytest.raises(ValueError, match="num_splits"):
        call(dataclasses.replace(good, num_splits=2))
    with pytest.raises(ValueError, match="split_min_tiles"):
        call(dataclasses.replace(good, split_min_tiles=0))
    with pytest.raises(ValueError, match="short_queries"):
        call(dataclasses.replace(good, short_queries=dataclasses.replace(good.short_queries, num_splits=2)))
    with pytest.raises(ValueError, match="short_queries"):
        call(dataclasses.replace(good, short_queries=good))
