"""Decode-side bookkeeping for a prompt whose KV is pulled from a prefill worker.

`plan_import` takes the blocks (reusing the ones this pool already caches), the caller pulls
the bytes of `ImportPlan.pull`, then `finish_import` caches the pulled full blocks; a failed
or cancelled pull hands the plan's blocks back with `BlockPool.release(plan.blocks)`.
`LmRunner.plan_import` / `finish_import` / `abort_import` are the entry points.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.kv.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding `num_tokens` token slots."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class ImportPlan:
    """Where a pulled prompt's KV goes on the decode side (see `LmRunner.plan_import`)."""

    blocks: list[int]  # block ids for prompt + generation, in order; one reference owned each
    pull: list[int]  # indices into the prompt's blocks whose bytes must be pulled
    reused: list[int]  # indices of full prompt blocks found in this runner's prefix cache


def plan_import(
    pool: BlockPool,
    block_size: int,
    hashes: list[bytes] | None,
    num_tokens: int,
    total_tokens: int,
) -> ImportPlan:
    """Take blocks from `pool` for a pulled prompt of `num_tokens` tokens.

    Full prompt blocks whose hash the pool caches are acquired (reused, not pulled); every
    other prompt block (the partial last one included) and the generation blocks up to
    `total_tokens` slots are allocated. The caller owns the plan's blocks. Raises
    `NoFreeBlocksError` with nothing taken.
    """
    prompt_blocks = blocks_for(num_tokens, block_size)
    found = [pool.get(h) for h in (hashes or [])]
    reused = [i for i, b in enumerate(found) if b is not None]
    pool.lookups += len(found)
    pool.hits += len(reused)
    hit_ids = [b for b in found if b is not None]
    pool.acquire(hit_ids)
    need = blocks_for(max(total_tokens, num_tokens), block_size) - len(hit_ids)
    try:
        fresh = iter(pool.allocate(need))
    except Exception:
        pool.release(hit_ids)
        raise
    blocks = [b if b is not None else next(fresh) for b in found]
    blocks.extend(fresh)
    reused_set = set(reused)
    pull = [i for i in range(prompt_blocks) if i not in reused_set]
    return ImportPlan(blocks=blocks, pull=pull, reused=reused)


def finish_import(pool: BlockPool, plan: ImportPlan, hashes: list[bytes] | None) -> None:
    """Cache the pulled full blocks under their hashes (their bytes are now valid)."""
    if not hashes:
        return
    full = [i for i in plan.pull if i < len(hashes)]
    if full:
        pool.cache_blocks([plan.blocks[i] for i in full], [hashes[i] for i in full])
