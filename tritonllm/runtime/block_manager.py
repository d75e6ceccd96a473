"""Paged KV-cache block allocator: ref counts, automatic prefix caching, fork with copy-on-write.

Pure Python on ints. A block holds the KV of `block_size` consecutive tokens of a sequence; token p of a
sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.

Block states:
- used: ref_count > 0, listed in the block tables of ref_count live sequences;
- free: ref_count == 0, in the free pool, in eviction order. A free block may still be *cached* (its full
  contents are registered under a prefix hash): a prefix hit takes it back out of the pool (revives it),
  an allocation that pops it evicts the hash. Uncached free blocks are popped before any cached one,
  cached ones in LRU order;
- held: ref_count == 0 but still read by a pending copy-on-write; it joins the pool in `take_block_copies`,
  so no block is both a copy source and a copy destination in one batch (the copy kernel runs all pairs
  in parallel).

Prefix-cache keys are chained: hash(block i) = SHA-256(hash(block i-1) || token ids of block i as int64),
so a key names the whole prefix up to the end of its block. SHA-256 rather than Python's 64-bit
`hash(tuple)`: a collision would silently serve one prompt another prompt's KV (wrong output, and a leak
across requests), and a 64-bit non-cryptographic hash can be collided on purpose by crafted prompts;
SHA-256 cannot, and costs well under a microsecond per 16-token block. Every message hashed has the same
length (32-byte parent + block_size * 8 bytes), so no two (parent, tokens) pairs encode alike.
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tritonllm.runtime.sequence import Sequence

_ROOT_HASH = bytes(32)  # the parent of a sequence's first block


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained prefix key of one full block: SHA-256(parent_hash || token ids as int64)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """Cached full blocks that cover the first `num_tokens` tokens of a sequence."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


NO_HIT = PrefixHit()


class BlockManager:
    """Owns `num_blocks` KV blocks and writes `Sequence.block_table` / `Sequence.block_hashes`.

    Life of a sequence: `lookup_prefix` + `can_allocate` + `allocate` on admission (it holds no blocks),
    `can_append` + `append_slots` for each later chunk or decode, `cache_full_blocks` after each step
    (registers blocks whose tokens are now all computed), `fork` for parallel samples, `free` at the end
    or on preemption. `take_block_copies` hands the copy-on-write pairs of the step to the runner.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must both be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # prefix hash -> block holding those tokens
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = next to go
        self._num_hashed: dict[int, int] = {}  # seq_id -> leading blocks of its table already registered
        self._copies: dict[int, int] = {}  # pending copy-on-write, dst -> src
        self._copy_readers: dict[int, int] = {}  # src -> pending copies reading it
        self._held: set[int] = set()  # ref 0, still a pending copy source
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

    # ---- accounting -------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take now (cached-but-free blocks included: they are evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._held)

    @property
    def num_held_blocks(self) -> int:
        return len(self._held)

    @property
    def usage(self) -> float:
        """Fraction of the pool not available to allocations."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def is_cached(self, block_id: int) -> bool:
        return self._block_hash[block_id] is not None

    # ---- admission --------------------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """Longest run of cached full blocks at the start of `seq` (which must hold no blocks).

        Stops at num_tokens - 1 tokens, so the last token is always computed and yields logits.
        Pure query: nothing is taken until `allocate`.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return NO_HIT
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._hash_blocks(seq, max_blocks)
        blocks = []
        for h in seq.block_hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Whether `allocate(seq, num_new_tokens, hit)` would find enough free blocks."""
        fresh = self.num_blocks_for(hit.num_tokens + num_new_tokens) - len(hit.block_ids)
        revived = sum(1 for b in hit.block_ids if self.ref_counts[b] == 0)
        return fresh + revived <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> None:
        """Admit `seq`: take the hit's cached blocks, then fresh ones for `num_new_tokens` more tokens.

        Sets seq.num_computed_tokens = seq.num_cached_tokens = hit.num_tokens (their KV is in the cache).
        `hit` must come from `lookup_prefix(seq)` with no allocation in between.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks; grow it with append_slots")
        if hit.num_tokens + num_new_tokens > seq.num_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens; cannot allocate for "
                f"{hit.num_tokens} cached + {num_new_tokens} new"
            )
        for i, b in enumerate(hit.block_ids):
            if self._block_hash[b] is None or self._block_hash[b] != seq.block_hashes[i]:
                raise ValueError(f"stale prefix hit for sequence {seq.seq_id}: call lookup_prefix right before")
        if not self.can_allocate(seq, num_new_tokens, hit):
            raise RuntimeError(f"out of KV blocks for sequence {seq.seq_id}; check can_allocate first")
        for b in hit.block_ids:
            if self.ref_counts[b] == 0:
                del self._free[b]  # revive a cached free block
            self.ref_counts[b] += 1
        seq.block_table = list(hit.block_ids)
        seq.num_computed_tokens = seq.num_cached_tokens = hit.num_tokens
        self._num_hashed[seq.seq_id] = len(hit.block_ids)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += hit.num_tokens
        self._grow(seq, hit.num_tokens + num_new_tokens)

    # ---- running sequences ------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `append_slots(seq, num_new_tokens)` would find enough free blocks (copies included)."""
        return self._append_cost(seq, num_new_tokens) <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make the block table cover num_computed_tokens + num_new_tokens tokens, writable.

        A block the new tokens land in that is shared (ref_count > 1, after a fork) is replaced by a
        private copy first; the (src, dst) pair is queued for `take_block_copies`.
        """
        if not self.try_append_slots(seq, num_new_tokens):
            raise RuntimeError(f"out of KV blocks for sequence {seq.seq_id}; check can_append first")

    def try_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """`append_slots` if the free blocks suffice (True), else nothing changes (False). One pass: the
        scheduler calls this for every running sequence every step."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        if end > seq.num_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens, {start} computed; cannot append {num_new_tokens}"
            )
        table = seq.block_table
        j = start // self.block_size
        if num_new_tokens == 1 and j < len(table) and self.ref_counts[table[j]] == 1:
            return True  # a decode into a private block that has room: the common case, nothing to do
        if self._append_cost(seq, num_new_tokens) > len(self._free):
            return False
        for j in range(seq.num_computed_tokens // self.block_size, min(len(table), self.num_blocks_for(end))):
            src = table[j]
            if self.ref_counts[src] > 1:
                dst = self._take_free()
                self.ref_counts[src] -= 1  # stays >= 1: other sequences still hold it
                table[j] = dst
                self._copies[dst] = src
                self._copy_readers[src] = self._copy_readers.get(src, 0) + 1
        self._grow(seq, end)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` whose tokens are now all computed (call after each step).

        Only computed blocks are registered, so a prefix hit never points at KV the runner has not written.
        """
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_hashed.get(seq.seq_id, 0)
        if num_full <= start:
            return
        self._hash_blocks(seq, num_full)
        for i in range(start, num_full):
            block, h = seq.block_table[i], seq.block_hashes[i]
            # First writer wins; a duplicate computed alongside stays unhashed and is evicted first.
            if self._block_hash[block] is None and h not in self._cached:
                self._cached[h] = block
                self._block_hash[block] = h
        self._num_hashed[seq.seq_id] = num_full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (same token ids as `parent`, no blocks) shares all of the parent's blocks."""
        if child.block_table:
            raise ValueError(f"fork target {child.seq_id} already holds blocks")
        for b in parent.block_table:
            self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        self._num_hashed[child.seq_id] = self._num_hashed.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks (finish, abort or preemption); the table empties.

        Tail blocks are released first, so they are evicted before the prefix blocks other prompts
        are likelier to share.
        """
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._release(b)
        seq.block_table = []
        self._num_hashed.pop(seq.seq_id, None)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last call; the runner copies them before
        the step's KV writes. Destinations are distinct and no block is both a source and a destination."""
        pairs = [(src, dst) for dst, src in self._copies.items()]
        self._copies.clear()
        self._copy_readers.clear()
        held, self._held = self._held, set()
        for b in held:
            self._release(b)
        return pairs

    def get_slot_ids(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of tokens start..end-1 of `seq` (the runner's slot_mapping for them)."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- internals --------------------------------------------------------------------------------

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        # Full blocks never change (tokens are only appended), so earlier hashes stay valid.
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else _ROOT_HASH, seq.token_ids[i * bs : (i + 1) * bs]))

    def append_needs(self, seq: Sequence, start: int, end: int) -> tuple[int, int]:
        """(fresh blocks, copy-on-write copies) that writing tokens start..end-1 of `seq` takes: blocks past its
        table, and shared blocks (ref_count > 1) among those the tokens land in."""
        end_blocks = self.num_blocks_for(end)
        table = seq.block_table
        first = start // self.block_size
        copies = sum(1 for j in range(first, min(len(table), end_blocks)) if self.ref_counts[table[j]] > 1)
        return max(0, end_blocks - len(table)), copies

    def _append_cost(self, seq: Sequence, num_new_tokens: int) -> int:
        return sum(self.append_needs(seq, seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks until the table covers `num_tokens` tokens; the caller has checked that enough
        are free and that no shared block is written (a continuation step, `Scheduler.schedule_continuation`)."""
        if self.num_blocks_for(num_tokens) - len(seq.block_table) > len(self._free):
            raise RuntimeError(f"out of KV blocks for sequence {seq.seq_id}; check get_num_free_blocks first")
        self._grow(seq, num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.num_blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._block_hash[block]
        if h is not None:  # evict: its prefix is no longer served
            del self._cached[h]
            self._block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        src = self._copies.pop(block, None)
        if src is not None:  # a pending copy into a block nobody holds any more is moot
            self._copy_readers[src] -= 1
            if self._copy_readers[src] == 0:
                del self._copy_readers[src]
                if src in self._held:
                    self._held.discard(src)
                    self._release(src)
        if block in self._copy_readers:
            self._held.add(block)
            return
        self._free[block] = None
        if self._block_hash[block] is None:
            self._free.move_to_end(block, last=False)  # worthless: reuse before any cached block
