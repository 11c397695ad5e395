"""Paged KV cache bookkeeping: which physical blocks each request owns.

The KV cache is a pool of fixed-size blocks; a request holds a list of block ids (its block
table) that grows as its sequence grows. Blocks come from a free list, so fragmentation never
limits how many sequences fit, and preemption gives a request's blocks back at once.

Prefix caching (issue 4) hooks in here: a full block is identified by `block_hash` (parent
hash, the block's token ids, and a hash of the embedding rows it covers, so that different
embeddings behind the same placeholder ids never share KV). `get_computed_blocks` is the
single place the scheduler asks for reusable blocks; with caching off it returns none.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence

from runner.request import Request


def block_hash(parent_hash: bytes | None, token_ids: Sequence[int], embeds_hash: bytes | None) -> bytes:
    """Content key of one full KV block: everything that determines its keys and values."""
    h = hashlib.sha256()
    h.update(parent_hash or b"root")
    h.update(b",".join(str(t).encode() for t in token_ids))
    h.update(embeds_hash or b"-")
    return h.digest()


class BlockManager:
    """Allocates KV blocks to requests from a free list; all-or-nothing per request and step.

    The free pool is reached only through `num_free_blocks`, `_take_free_block` and
    `_return_free_blocks`, which `PrefixCachingBlockManager` overrides (its freed blocks stay
    findable by content until taken again); allocation and freeing themselves are shared.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_cnt = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _take_free_block(self) -> int:
        return self._free.popleft()

    def _return_free_blocks(self, blocks: list[int]) -> None:
        """Back to the pool, in order: one call for a whole request (a method call per block was a
        visible share of a large batch's host time)."""
        self._free.extend(blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` still needs so that its table covers `num_tokens` positions."""
        return max(0, self.num_blocks_for(num_tokens) - len(request.block_ids))

    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        """Grow `request.block_ids` to cover `num_tokens` positions; False (nothing taken) if short."""
        need = self.num_new_blocks(request, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            block = self._take_free_block()
            self._ref_cnt[block] = 1
            request.block_ids.append(block)
        return True

    def free(self, request: Request) -> None:
        """Give every block of `request` back (last block first, so recently used blocks are reused last)."""
        ref_cnt, freed = self._ref_cnt, []
        for block in reversed(request.block_ids):
            left = ref_cnt[block] - 1
            ref_cnt[block] = left
            if left == 0:
                freed.append(block)
        self._return_free_blocks(freed)
        request.block_ids = []

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Prefix-cache hook: (reusable block ids, tokens they cover) for a newly admitted request.

        None without prefix caching (`runner.engine.prefix_cache.PrefixCachingBlockManager` finds them).
        """
        return [], 0
