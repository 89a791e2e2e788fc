"""The KV allocator of one worker: which blocks a request gets, and what enters the cache.

`KvAllocator` wraps the worker's `BlockPool` with the block decisions of both roles (the
model runner never takes or frees a block):

    hashes(tokens, params, salt, lora)      -> block hashes under this worker's root, or None
    cached_prefix(hashes, n)                -> cached prefix blocks a prefill may reuse
    allocate_prompt(cached, total)          -> those blocks acquired + fresh ones for `total`
    cache_prompt(blocks, hashes, n, reused) -> the newly computed full blocks enter the cache
    plan_import(hashes, n, total, digests_now) / finish_import / abort_import (decode: pulled KV)
    release(blocks)
    record_digests / digest_of / check_prefix / uncache             (bytes bound to keys)
    cached_hashes() + listeners             -> snapshot + live events for the KV event hub

Block hashes: every hash chains from `root`: a worker's `layout_root(kv_layout)` (model
identity + KV layout), so two workers exchange or reuse blocks only when model and layout
agree; the offline Engine, whose cache is private, uses `common.kv.hashing.DEFAULT_ROOT`. A prompt
whose layout cannot be hashed is *uncacheable* (`hashes` returns None): it is computed,
never cached, never offered for transfer by hash.

Block ownership: every block id `allocate_prompt` or `plan_import` returns is owned by the
caller with one reference until `release` / `abort_import` or a hand-over of those ids (to a
sequence, a lease); cached blocks stay cached after release (LRU-evictable).

Digests (DESIGN §4): the digest of a block's bytes (`common.kv.digest`) is recorded by
block id when the block is computed (or pulled and verified) and forgotten when the id is
allocated again. Before a prefill reuses cached blocks, `check_prefix` compares their bytes'
digests now with the recorded ones and uncaches the first block whose bytes changed, so a
corrupted block is recomputed instead of served; a decode worker's `plan_import` given
`digests_now` does the same for every cached block it would reuse, which is pulled instead.

Events: the pool calls the allocator with every change, which passes it to each of
`listeners` on the same thread; `cached_hashes` is read from the pool itself, so a listener
that takes the snapshot and subscribes in one call on that thread misses nothing and sees
nothing twice. Not thread-safe: callers serialize every call (workers use one model thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.kv.block_pool import BlockPool, KvEvent
from common.kv.hashing import block_hashes, prompt_digest
from common.multimodal.params import MultimodalParams

logger = logging.getLogger(__name__)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding `num_tokens` token slots."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class ImportPlan:
    """Where a pulled prompt's KV goes on the decode side (see `KvAllocator.plan_import`)."""

    blocks: list[int]  # block ids for prompt + generation, in order; one reference owned each
    pull: list[int]  # indices into the prompt's blocks whose bytes must be pulled
    reused: list[int]  # indices of full prompt blocks found in this worker's prefix cache


@dataclass(eq=False, slots=True)
class KvAllocator:
    """Block decisions over one worker's pool; see the module docstring."""

    pool: BlockPool  # the worker's blocks; its events come back through `_on_event`
    block_size: int  # tokens per block (the cache's)
    root: bytes  # the hash every block hash chains from
    # Called with every KV event, on the thread that made it (the allocator's caller).
    listeners: list[Callable[[KvEvent], None]] = field(default_factory=list)
    # Block id -> digest of its bytes when computed; dropped when the id is allocated again.
    digests: dict[int, bytes] = field(default_factory=dict)
    digest_mismatches: int = 0  # cached blocks whose bytes changed after they were computed

    def __post_init__(self) -> None:
        self.pool.on_event = self._on_event

    @classmethod
    def create(cls, num_blocks: int, block_size: int, root: bytes) -> KvAllocator:
        """An allocator over a fresh pool of `num_blocks` (events go to `listeners` only)."""
        return cls(BlockPool(num_blocks, record_events=False), block_size, root)

    # ------------------------------------------------------------------------ hashing

    def hashes(
        self,
        prompt_token_ids: Sequence[int],
        params: MultimodalParams,
        *,
        cache_salt: str | None = None,
        lora_id: str | None = None,
    ) -> list[bytes] | None:
        """Hashes of the prompt's full blocks under this worker's root; None = uncacheable."""
        try:
            return block_hashes(
                prompt_token_ids,
                self.block_size,
                params,
                cache_salt=cache_salt,
                lora_id=lora_id,
                root=self.root,
            )
        except ValueError:
            logger.warning("prompt layout cannot be hashed; request is uncacheable")
            return None

    def prompt_digest(
        self,
        prompt_token_ids: Sequence[int],
        params: MultimodalParams,
        *,
        cache_salt: str | None = None,
        lora_id: str | None = None,
    ) -> bytes:
        """`hashing.prompt_digest` of the whole prompt under this worker's root."""
        return prompt_digest(
            prompt_token_ids, params, cache_salt=cache_salt, lora_id=lora_id, root=self.root
        )

    # ------------------------------------------------------------------------ prefill

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether blocks for `num_tokens` slots are free now (ignoring any cache hit)."""
        return self.pool.can_allocate(blocks_for(num_tokens, self.block_size))

    def cached_prefix(self, hashes: list[bytes] | None, num_tokens: int) -> list[int]:
        """The cached blocks a prefill of `num_tokens` reuses: the longest cached prefix of
        `hashes`, at most `(n - 1) // block_size` blocks so the last token is computed (its
        logits give the first token). Takes no reference and counts nothing: the caller
        counts the blocks it reuses (`pool.count_lookups`)."""
        found = self.pool.find_cached_prefix(hashes or [], count=False)
        return found[: (num_tokens - 1) // self.block_size]

    def allocate_prompt(self, cached: list[int], total_tokens: int) -> list[int]:
        """`cached` (acquired) followed by fresh blocks up to `total_tokens` slots, owned by
        the caller. Raises `NoFreeBlocksError` with nothing taken."""
        self.pool.acquire(cached)
        try:
            fresh = self._allocate(blocks_for(total_tokens, self.block_size) - len(cached))
        except Exception:
            self.pool.release(cached)
            raise
        return cached + fresh

    def cache_prompt(
        self, blocks: list[int], hashes: list[bytes] | None, num_tokens: int, reused: int
    ) -> None:
        """Cache the prompt's full blocks past the `reused` cached ones (their K/V are now
        computed) under `hashes`; None caches nothing."""
        full = num_tokens // self.block_size
        if hashes and full > reused:
            self.pool.cache_blocks(blocks[reused:full], hashes[reused:full])

    def release(self, blocks: list[int]) -> None:
        """Give back one reference on each block (cached ones stay cached, evictable)."""
        self.pool.release(blocks)

    # ------------------------------------------------------------------------- import

    def plan_import(
        self,
        hashes: list[bytes] | None,
        num_tokens: int,
        total_tokens: int,
        digests_now: Callable[[list[int]], Sequence[bytes]] | None = None,
    ) -> ImportPlan:
        """Take blocks for a prompt of `num_tokens` whose KV is pulled from a prefill worker.

        Full prompt blocks whose hash the pool caches are acquired (reused, not pulled);
        every other prompt block (the partial last one included) and the generation blocks
        up to `total_tokens` slots are allocated. With `digests_now` (block ids -> the
        digests of their bytes now), a cached block whose bytes no longer have the digest
        recorded for them is uncached and counted (`_drop_changed`) and pulled instead.
        The caller owns the plan's blocks and must pass the plan to `finish_import` (after
        the pull) or `abort_import`. Raises `NoFreeBlocksError` with nothing taken (and
        nothing counted: a request that waits for blocks plans again).
        """
        pool, bs = self.pool, self.block_size
        found = pool.find_cached(hashes or [], count=False)
        if digests_now is not None:  # reuse only blocks whose bytes are still the ones pulled
            changed = self._drop_changed([b for b in found if b is not None], digests_now)
            found = [None if b in changed else b for b in found]
        hit_ids = [b for b in found if b is not None]
        pool.acquire(hit_ids)
        need = blocks_for(max(total_tokens, num_tokens), bs) - len(hit_ids)
        try:
            fresh = iter(self._allocate(need))
        except Exception:
            pool.release(hit_ids)
            raise
        pool.count_lookups(len(found), len(hit_ids))
        blocks = [b if b is not None else next(fresh) for b in found]
        blocks.extend(fresh)
        reused = [i for i, b in enumerate(found) if b is not None]
        reused_set = set(reused)
        pull = [i for i in range(blocks_for(num_tokens, bs)) if i not in reused_set]
        return ImportPlan(blocks=blocks, pull=pull, reused=reused)

    def finish_import(
        self,
        plan: ImportPlan,
        hashes: list[bytes] | None,
        digests: Sequence[bytes] | None = None,
    ) -> None:
        """Cache the pulled full blocks under their hashes (their bytes are now valid and,
        when `digests` (one per prompt block) is given, match them: they are recorded)."""
        if digests is not None:
            self.record_digests(
                [plan.blocks[i] for i in plan.pull], [digests[i] for i in plan.pull]
            )
        if not hashes:
            return
        full = [i for i in plan.pull if i < len(hashes)]
        if full:
            self.pool.cache_blocks([plan.blocks[i] for i in full], [hashes[i] for i in full])

    def abort_import(self, plan: ImportPlan) -> None:
        """Give back every block of a plan whose pull failed or was cancelled."""
        self.pool.release(plan.blocks)

    # ------------------------------------------------------------------------ digests

    def record_digests(self, block_ids: Sequence[int], digests: Sequence[bytes]) -> None:
        """Record the digest of each block's bytes, just computed (or verified)."""
        if len(block_ids) != len(digests):
            raise ValueError(f"{len(block_ids)} blocks for {len(digests)} digests")
        self.digests.update(zip(block_ids, digests, strict=True))

    def digest_of(self, block_id: int) -> bytes | None:
        """The recorded digest of a block's bytes, or None."""
        return self.digests.get(block_id)

    def check_prefix(self, cached: list[int], digests_now: Sequence[bytes]) -> list[int]:
        """The leading blocks of `cached` whose bytes' digest now (`digests_now`) is the one
        recorded when they were computed. The first block that differs (or has none
        recorded) is uncached and counted; it and the blocks after it are not returned."""
        for j, (block_id, now) in enumerate(zip(cached, digests_now, strict=True)):
            if self.digests.get(block_id) != now:
                self._changed(block_id)
                return cached[:j]
        return cached

    def _drop_changed(
        self, block_ids: list[int], digests_now: Callable[[list[int]], Sequence[bytes]]
    ) -> set[int]:
        """The cached `block_ids` whose bytes' digest now differs from the recorded one (or
        has none recorded), each uncached and counted."""
        if not block_ids:
            return set()
        now = digests_now(block_ids)
        changed = {b for b, d in zip(block_ids, now, strict=True) if self.digests.get(b) != d}
        for block_id in changed:
            self._changed(block_id)
        return changed

    def _changed(self, block_id: int) -> None:
        self.digest_mismatches += 1
        logger.error("cached KV block %d changed after it was verified; dropping it", block_id)
        self.uncache([block_id])

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Take blocks out of the prefix cache (their bytes can no longer be trusted); held
        ones stay with their holders and are freed on release."""
        for block_id in block_ids:
            self.digests.pop(block_id, None)
            self.pool.uncache_block(block_id)

    def _allocate(self, n: int) -> list[int]:
        """`pool.allocate`, forgetting the digests of the ids handed out (their bytes will
        be overwritten)."""
        fresh = self.pool.allocate(n)
        for block_id in fresh:
            self.digests.pop(block_id, None)
        return fresh

    # ------------------------------------------------------------------------- events

    def cached_hashes(self) -> list[bytes]:
        """Every hash in the prefix cache, in the order it entered (the event snapshot)."""
        return self.pool.cached_hashes()

    def _on_event(self, event: KvEvent) -> None:
        for listener in self.listeners:
            listener(event)
