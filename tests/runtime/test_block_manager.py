import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tritonllm.runtime.block_manager import BlockManager
from tritonllm.runtime.sequence import Sequence

_ids = itertools.count()


def make_seq(tokens: list[int], ids: Iterator[int] = _ids) -> Sequence:
    seq_id = next(ids)
    return Sequence(seq_id, f"r{seq_id}", list(tokens), len(tokens), None, arrival=seq_id)


def run(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    """Admit or grow `seq` by num_new tokens and mark them computed, as one scheduler step would."""
    if seq.block_table or seq.num_computed_tokens:
        bm.append_slots(seq, num_new)
    else:
        bm.allocate(seq, num_new, bm.lookup_prefix(seq))
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq)


# ---- stateful model: a fake KV cache holds the token id written to each slot ---------------------------

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 0, 0, 0, 0], [0, 0, 0, 0, 1, 2, 3, 4]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences are admitted (with prefix hits), grown, forked and freed; a `run` rule executes the pending
    batch like the runner (copy-on-write pairs first, then the KV writes of the new tokens)."""

    caching = True

    @initialize(num_blocks=st.sampled_from([3, 8, 16]), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=self.caching)
        self.kv = [None] * (num_blocks * block_size)
        self.live: list[Sequence] = []
        self.pending: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (seq, new tokens) of this batch
        self.history: list[list[int]] = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]  # token ids seen, to re-prompt with
        self.ids = itertools.count()  # per run: ids (and the tokens sampled from them) replay exactly

    def _idle(self) -> list[Sequence]:
        return [s for s in self.live if s.seq_id not in self.pending]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=9), chunk=st.integers(1, 13))
    def admit(self, prefix, suffix, chunk):
        self._admit((prefix + suffix) or [7], chunk)

    @rule(data=st.data(), cut=st.integers(-3, 3), chunk=st.integers(1, 13))
    def admit_seen_prompt(self, data, cut, chunk):
        """Re-prompt with tokens seen before, cut or extended a little: prefix hits and their cap."""
        tokens = data.draw(st.sampled_from(self.history))
        self._admit((tokens[:cut] if cut < 0 else tokens + [0] * cut) or [7], chunk)

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), chunk=st.integers(1, 13))
    def grow(self, data, chunk):
        self._grow(data.draw(st.sampled_from(self._idle())), chunk)

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), write=st.sampled_from(["none", "child", "both", "child, parent freed"]))
    def fork(self, data, write):
        """Parallel sampling: the child (and maybe the parent) then writes its next token into shared blocks;
        a parent freed right after leaves the copy source to nobody but the pending copy."""
        parent = data.draw(st.sampled_from(self._idle()))
        child = make_seq(parent.token_ids, self.ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.bm.fork(parent, child)
        assert child.block_table == parent.block_table
        self.live.append(child)
        if write != "none":
            self._grow(child, 1)
        if write == "both":
            self._grow(parent, 1)
        if write == "child, parent freed":
            self.bm.free(parent)
            self.live.remove(parent)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        assert seq.block_table == []
        self.live.remove(seq)
        self.pending.pop(seq.seq_id, None)

    def _admit(self, tokens: list[int], chunk: int) -> None:
        seq = make_seq(tokens, self.ids)
        hit = self.bm.lookup_prefix(seq)
        bs = self.bm.block_size
        assert hit.num_tokens <= seq.num_tokens - 1 and hit.num_tokens == len(hit.block_ids) * bs
        if not self.caching:
            assert hit.num_tokens == 0
        for j, block in enumerate(hit.block_ids):  # a hit serves exactly this prompt's tokens, full blocks only
            assert self.bm.is_cached(block)
            assert self.kv[block * bs : (block + 1) * bs] == seq.token_ids[j * bs : (j + 1) * bs]
        n = min(chunk, seq.num_tokens - hit.num_tokens)
        free_before = self.bm.get_num_free_blocks()
        if not self.bm.can_allocate(seq, n, hit):
            return
        self.bm.allocate(seq, n, hit)
        assert seq.num_computed_tokens == hit.num_tokens
        revived = sum(1 for b in hit.block_ids if self.bm.ref_counts[b] == 1)
        fresh = self.bm.num_blocks_for(seq.num_computed_tokens + n) - len(hit.block_ids)
        assert free_before - self.bm.get_num_free_blocks() == fresh + revived
        self.live.append(seq)
        self.pending[seq.seq_id] = (seq, n)

    def _grow(self, seq: Sequence, chunk: int) -> None:
        if seq.num_computed_tokens == seq.num_tokens:  # "sample" the next token
            seq.append_token((seq.seq_id + seq.num_tokens) % 4)
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        fits = self.bm.can_append(seq, n)
        table, free = list(seq.block_table), self.bm.get_num_free_blocks()
        # The scheduler's one-pass form agrees with the two-step one, and a refusal changes nothing.
        assert self.bm.try_append_slots(seq, n) == fits
        if fits:
            self.pending[seq.seq_id] = (seq, n)
        else:
            assert seq.block_table == table and self.bm.get_num_free_blocks() == free

    @rule()
    def run(self):
        pairs = self.bm.take_block_copies()
        srcs, dsts = {s for s, _ in pairs}, [d for _, d in pairs]
        assert len(set(dsts)) == len(dsts) and not srcs & set(dsts)
        assert self.bm.num_held_blocks == 0
        bs = self.bm.block_size
        data = {src: self.kv[src * bs : (src + 1) * bs] for src in srcs}
        for src, dst in pairs:
            self.kv[dst * bs : (dst + 1) * bs] = data[src]
        for seq, n in self.pending.values():
            start = seq.num_computed_tokens
            slots = self.bm.get_slot_ids(seq, start, start + n)
            for slot, token in zip(slots, seq.token_ids[start : start + n], strict=True):
                self.kv[slot] = token
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
            self.history.append(seq.token_ids[: seq.num_computed_tokens])
        self.pending.clear()
        for seq in self.live:  # every computed token reads back its own id: no aliasing, copies applied
            computed = seq.num_computed_tokens
            assert [self.kv[s] for s in self.bm.get_slot_ids(seq, 0, computed)] == seq.token_ids[:computed]

    @invariant()
    def ownership(self):
        owners = Counter(b for s in self.live for b in s.block_table)
        for s in self.live:
            assert len(set(s.block_table)) == len(s.block_table), "a block appears twice in one table"
            assert self.bm.num_blocks_for(s.num_computed_tokens) <= len(s.block_table)
            assert len(s.block_table) <= self.bm.num_blocks_for(s.num_tokens)
        assert min(self.bm.ref_counts) >= 0
        assert all(self.bm.ref_counts[b] == owners.get(b, 0) for b in range(self.bm.num_blocks))
        used = len(owners)
        assert self.bm.get_num_free_blocks() + used + self.bm.num_held_blocks == self.bm.num_blocks

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            self.bm.free(seq)
        self.bm.take_block_copies()
        assert self.bm.get_num_free_blocks() == self.bm.num_blocks
        assert self.bm.ref_counts == [0] * self.bm.num_blocks


class BlockManagerNoCachingMachine(BlockManagerMachine):
    caching = False


_machine_settings = settings(max_examples=100, stateful_step_count=50)
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _machine_settings
TestBlockManagerNoCachingStateful = BlockManagerNoCachingMachine.TestCase
TestBlockManagerNoCachingStateful.settings = _machine_settings


# ---- prefix caching ----------------------------------------------------------------------------------


def test_prefix_hit_reuses_full_blocks_and_stops_before_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    run(bm, a, 10)
    same = make_seq(list(range(10)))
    hit = bm.lookup_prefix(same)
    assert hit.block_ids == tuple(a.block_table[:2]) and hit.num_tokens == 8
    exact = make_seq(list(range(8)))  # two full blocks: the last token must still be computed
    assert bm.lookup_prefix(exact).block_ids == (a.block_table[0],)
    longer = make_seq(list(range(12)))  # a's third block was partial: never shared
    assert bm.lookup_prefix(longer).num_tokens == 8
    other_head = make_seq([9, 9, 9, 9] + list(range(4, 10)))  # same second block, different parent
    assert bm.lookup_prefix(other_head).num_tokens == 0

    free_before = bm.get_num_free_blocks()
    bm.allocate(same, 2, bm.lookup_prefix(same))
    assert same.block_table[:2] == a.block_table[:2] and same.block_table[2] != a.block_table[2]
    assert same.num_computed_tokens == same.num_cached_tokens == 8
    assert [bm.ref_counts[b] for b in same.block_table] == [2, 2, 1]
    assert bm.get_num_free_blocks() == free_before - 1
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)
    assert bm.prefix_cache_hit_rate == pytest.approx(0.4)


def test_decode_filled_blocks_are_cached():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([5, 6, 7])
    run(bm, a, 3)
    a.append_token(8)  # decode fills block 1 with [7, 8]
    run(bm, a, 1)
    b = make_seq([5, 6, 7, 8, 1])
    assert bm.lookup_prefix(b).block_ids == tuple(a.block_table[:2])


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    x, y = make_seq([1, 1, 1, 1, 0]), make_seq([2, 2, 2, 2, 0])
    run(bm, x, 4)
    run(bm, y, 4)
    x_blocks, y_blocks = x.block_table[:], y.block_table[:]
    bm.free(x)  # freed first: least recently used
    bm.free(y)
    assert bm.get_num_free_blocks() == 4  # cached blocks stay reusable
    again = make_seq([2, 2, 2, 2, 5])
    hit = bm.lookup_prefix(again)
    assert hit.block_ids == tuple(y_blocks)
    bm.allocate(again, 1, hit)  # revives y's blocks; the fresh one evicts x's tail first
    assert bm.get_num_free_blocks() == 1 and again.block_table[2] == x_blocks[1]
    assert bm.lookup_prefix(make_seq([1, 1, 1, 1, 0])).block_ids == (x_blocks[0],)
    bm.free(again)
    big = make_seq([3] * 7)
    run(bm, big, 7)  # needs all 4 blocks: every cached prefix is evicted
    assert bm.lookup_prefix(make_seq([2, 2, 2, 2, 5])).num_tokens == 0
    assert bm.lookup_prefix(make_seq([1, 1, 1, 1, 0])).num_tokens == 0


def test_uncached_free_blocks_are_used_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])  # one full (cached) block, one partial
    run(bm, a, 3)
    full, partial = a.block_table
    bm.free(a)
    b = make_seq([9, 9, 9])
    run(bm, b, 1)
    assert b.block_table == [partial]
    assert bm.lookup_prefix(make_seq([1, 2, 3])).block_ids == (full,)


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    run(bm, a, 5)
    b = make_seq([1, 2, 3, 4, 5])
    assert bm.lookup_prefix(b).num_tokens == 0
    run(bm, b, 5)
    assert not set(a.block_table) & set(b.block_table)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


def test_stale_hit_is_refused():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_seq([1, 2, 3])
    run(bm, a, 3)
    bm.free(a)
    b = make_seq([1, 2, 3])
    hit = bm.lookup_prefix(b)
    run(bm, make_seq([7, 7, 7, 7]), 4)  # evicts the hit block
    with pytest.raises(ValueError, match="stale prefix hit"):
        bm.allocate(b, 1, hit)


# ---- fork and copy-on-write -------------------------------------------------------------------------


def fork_after_prompt(bm: BlockManager, prompt: list[int]) -> tuple[Sequence, Sequence]:
    parent = make_seq(prompt)
    run(bm, parent, len(prompt) - 1)
    child = make_seq(prompt)
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    return parent, child


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = fork_after_prompt(bm, [1, 2, 3, 4, 5, 6])  # blocks: full [1..4], partial [5]
    full, shared = parent.block_table
    assert child.block_table == [full, shared] and bm.ref_counts[full] == bm.ref_counts[shared] == 2
    free_before = bm.get_num_free_blocks()
    assert bm.can_append(child, 1)
    bm.append_slots(child, 1)  # writes token 6 into the shared partial block: copy it first
    assert child.block_table[0] == full and child.block_table[1] not in (full, shared)
    assert bm.take_block_copies() == [(shared, child.block_table[1])]
    assert bm.get_num_free_blocks() == free_before - 1
    bm.append_slots(parent, 1)  # the parent now owns `shared` alone: writes in place
    assert parent.block_table == [full, shared] and bm.take_block_copies() == []
    assert bm.ref_counts[full] == 2 and bm.ref_counts[shared] == 1


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=2)
    parent, child = fork_after_prompt(bm, [1, 2, 3, 4, 5])  # 4 computed: two full blocks
    bm.append_slots(child, 1)
    bm.append_slots(parent, 1)
    assert bm.take_block_copies() == []
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != parent.block_table[2]


def test_copy_source_freed_mid_step_is_held_until_copies_are_taken():
    bm = BlockManager(num_blocks=3, block_size=4)
    parent, child = fork_after_prompt(bm, [1, 2, 3])
    (shared,) = parent.block_table
    bm.append_slots(child, 1)
    bm.free(parent)  # the copy still has to read `shared`
    assert bm.ref_counts[shared] == 0 and bm.num_held_blocks == 1
    assert bm.get_num_free_blocks() == 1
    assert bm.take_block_copies() == [(shared, child.block_table[0])]
    assert bm.num_held_blocks == 0 and bm.get_num_free_blocks() == 2


def test_copy_into_a_freed_block_is_dropped():
    bm = BlockManager(num_blocks=3, block_size=4)
    parent, child = fork_after_prompt(bm, [1, 2, 3])
    bm.append_slots(child, 1)
    bm.free(child)
    assert bm.take_block_copies() == []
    bm.free(parent)
    assert bm.get_num_free_blocks() == 3


def test_out_of_blocks_is_reported_not_half_done():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    assert not bm.can_allocate(a, 5)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(a, 5)
    assert a.block_table == [] and bm.get_num_free_blocks() == 2
    run(bm, a, 4)
    with pytest.raises(RuntimeError, match="can_append"):
        bm.append_slots(a, 1)


def test_slot_ids_follow_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(10)))
    a.block_table = [5, 2, 7]
    assert bm.get_slot_ids(a, 2, 9) == [22, 23, 8, 9, 10, 11, 28]
