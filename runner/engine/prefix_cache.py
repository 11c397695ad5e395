"""Prefix caching: reuse the KV blocks of a prompt prefix already computed, keyed by content.

A full block's key chains its parent's key with the block's token ids and a hash of the
embedding rows it covers (`runner.engine.block_manager.block_hash`). Token ids alone are not enough:
every embeds prompt holds the same placeholder id under different rows, and two requests with
different media behind the same `<image>` ids must never share KV. The embedding part is:

- for media / passthrough items (`request.mm_features`): each overlapping item's identifier
  (modality + content hash) and the slice of its placeholder the block covers;
- for a whole-prompt embeds prompt: the bytes of the block's rows that are not token ids
  (dtype and shape included, `tensor_content_hash`).

Only full blocks whose KV is computed are registered (blocks fully below `num_computed_tokens`,
checked whenever the request allocates or frees), so a hit never reads KV still being written.
Freed blocks keep their key and stay in the free pool as evictable: allocation takes the least
recently freed block first and drops its key. A request asking for prompt logprobs skips the
lookup (its skipped positions would have no logprobs). A hit never covers the last prompt
token: the step that computes it must produce logits.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from runner.engine.block_manager import BlockManager, block_hash
from runner.multimodal.encoder_protocol import tensor_content_hash
from runner.request import Request


def block_embeds_hash(request: Request, start: int, end: int) -> bytes | None:
    """Hash of the embedding rows behind positions `[start, end)` of `request`, None if none."""
    parts: list[str] = []
    for feature in request.mm_features:
        ph = feature.placeholder
        if ph.offset < end and ph.end > start:
            parts.append(f"{feature.identifier}[{max(start, ph.offset) - ph.offset}:"
                         f"{min(end, ph.end) - ph.offset}]")
    embeds = request.prompt_embeds
    if embeds is not None and start < embeds.shape[0]:
        stop = min(end, embeds.shape[0])
        rows = embeds[start:stop]
        if request.is_token_ids is not None:
            keep = ~request.is_token_ids[start:stop].to(torch.bool)
            parts.append("mask:" + "".join("1" if k else "0" for k in keep.tolist()))
            rows = rows[keep.to(rows.device)]
        parts.append("rows:" + tensor_content_hash(rows))
    if not parts:
        return None
    return hashlib.sha256("|".join(parts).encode()).digest()


def ensure_block_hashes(request: Request, num_blocks: int, block_size: int) -> list[bytes]:
    """Extend `request.block_hashes` to its first `num_blocks` full blocks; returns the list."""
    hashes = request.block_hashes
    if len(hashes) >= num_blocks:
        return hashes
    n_prompt = request.num_prompt_tokens
    for i in range(len(hashes), num_blocks):
        a, b = i * block_size, (i + 1) * block_size
        if b <= n_prompt:
            ids = request.prompt_token_ids[a:b]
        else:
            ids = [request.token_id_at(p) for p in range(a, b)]
        hashes.append(block_hash(hashes[-1] if hashes else None, ids, block_embeds_hash(request, a, b)))
    return hashes


class PrefixCachingBlockManager(BlockManager):
    """`BlockManager` whose computed full blocks are found again by content (module docstring).

    Counters: `num_queried_blocks` (full prompt blocks looked up at admission), `num_hit_blocks`
    (found), `num_cached_blocks` (blocks holding a key now, in use or evictable).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        # Free pool in LRU order (least recently freed first); cached blocks stay here, evictable.
        # It replaces the base class's deque, which is left empty.
        self._free.clear()
        self._free_lru: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._num_registered: dict[str, int] = {}
        self.num_queried_blocks = 0
        self.num_hit_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of_block)

    def reset_prefix_cache(self) -> None:
        """Forget every key of a free block (a block in use keeps its key): the engine's warm-up
        requests must not stay findable as cached prefixes."""
        for block in self._free_lru:
            key = self._hash_of_block.pop(block, None)
            if key is not None:
                del self._block_of_hash[key]

    def _take_free_block(self) -> int:
        """The least recently freed block; its key (if any) is dropped: it is about to be rewritten."""
        block, _ = self._free_lru.popitem(last=False)
        key = self._hash_of_block.pop(block, None)
        if key is not None:
            del self._block_of_hash[key]
        return block

    def _return_free_blocks(self, blocks: list[int]) -> None:
        for block in blocks:
            self._free_lru[block] = None  # keeps its key: evictable, still found by content

    def _register_computed(self, request: Request) -> None:
        """Key every full block of `request` whose KV is computed and not yet keyed."""
        bs = self.block_size
        # Tokens of a decode window still in flight count as computed but their ids are not known yet.
        known = request.num_prompt_tokens + request.num_output_tokens
        n_full = min(min(request.num_computed_tokens, known) // bs, len(request.block_ids))
        done = self._num_registered.get(request.request_id, 0)
        if n_full <= done:
            return
        hashes = ensure_block_hashes(request, n_full, bs)
        for i in range(done, n_full):
            block, key = request.block_ids[i], hashes[i]
            if block not in self._hash_of_block and key not in self._block_of_hash:
                self._hash_of_block[block] = key
                self._block_of_hash[key] = block
        self._num_registered[request.request_id] = n_full

    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        self._register_computed(request)
        return super().allocate_slots(request, num_tokens)

    def free(self, request: Request) -> None:
        self._register_computed(request)
        super().free(request)
        self._num_registered.pop(request.request_id, None)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Take the cached blocks of `request`'s longest keyed prefix (appended to its block table).

        The scheduler calls this for a waiting request (empty block table) and must `free` the
        request again if it then cannot allocate the rest.
        """
        if request.block_ids or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks <= 0:
            return [], 0
        hashes = ensure_block_hashes(request, max_blocks, bs)
        hits: list[int] = []
        for key in hashes[:max_blocks]:
            block = self._block_of_hash.get(key)
            if block is None:
                break
            hits.append(block)
        self.num_queried_blocks += max_blocks
        self.num_hit_blocks += len(hits)
        for block in hits:
            if self._ref_cnt[block] == 0:
                del self._free_lru[block]
            self._ref_cnt[block] += 1
            request.block_ids.append(block)
        # Hit blocks are already keyed: registration resumes after them.
        self._num_registered[request.request_id] = len(hits)
        return hits, len(hits) * bs


__all__ = ["PrefixCachingBlockManager", "block_embeds_hash", "ensure_block_hashes"]
