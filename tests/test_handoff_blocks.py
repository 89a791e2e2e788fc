"""Which KV blocks a prefill -> decode handoff carries and decode pulls, over real NIXL READs
between in-process workers (the `cluster` of tests/test_kv_handoff.py): a new question about
the same video reuses the shared prefix on both sides and pulls only the blocks decode lacks
(counters and bytes to match), and raw prompts around block edges (shorter than a block,
exactly full blocks, one token either side) hash only full blocks, ship the partial one, and
answer as the offline `Engine` does.
"""

from __future__ import annotations

import pytest

from common.engine import Engine
from common.kv.allocator import blocks_for
from common.kv.hashing import block_hashes
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams
from tests.test_kv_handoff import (
    BLOCK,
    GREEDY,
    Cluster,
    assert_same,
    ckpt,
    cluster,
    decode_request,
    engine,
    generate,
    make_handoff,
    run_decode,
    run_prefill,
    user,
    vid_part,
)

__all__ = ["ckpt", "cluster", "engine"]  # module fixtures shared with test_kv_handoff

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_same_video_new_question_pulls_only_missing_blocks(cluster: Cluster) -> None:
    c = cluster
    first_q = user(vid_part(7), "What happens first?")
    second_q = user(vid_part(7), "And what happens at the very end of it?")
    t1, p1 = make_handoff(c.engine, first_q)
    t2, p2 = make_handoff(c.engine, second_q)
    root = c.decode.servicer.runner.allocator.root
    h1 = block_hashes(t1, BLOCK, p1, root=root)
    h2 = block_hashes(t2, BLOCK, p2, root=root)
    common = next(i for i, (a, b) in enumerate(zip(h1, h2, strict=False)) if a != b)
    assert common >= 4  # the video spans several shared blocks

    reply1, answer1 = await generate(c, first_q, GREEDY)
    assert_same(answer1, c.expected(first_q, GREEDY))
    assert reply1.cached_tokens == 0
    decode_cache = set(c.decode.servicer.runner.allocator.cached_hashes())
    assert set(h1) <= decode_cache  # every pulled full block entered decode's cache
    before = c.decode.servicer.counters
    pulled0, bytes0, reused0 = before.blocks_pulled, before.bytes_pulled, before.blocks_reused

    reply2 = await run_prefill(c, t2, p2, GREEDY)
    assert reply2.cached_tokens == common * BLOCK
    assert reply2.computed_tokens == len(t2) - common * BLOCK
    assert list(reply2.kv.block_hashes) == h2
    answer2 = await run_decode(c, decode_request(t2, p2, GREEDY, reply2))
    assert_same(answer2, c.expected(second_q, GREEDY))

    lacked = [i for i, h in enumerate(h2) if h not in decode_cache]
    want_pulled = len(lacked) + (1 if len(t2) % BLOCK else 0)  # + the partial last block
    head = answer2.chunks[0]
    assert head.blocks_reused == len(h2) - len(lacked)
    assert head.blocks_pulled == want_pulled
    counters = c.decode.servicer.counters
    block_bytes = reply2.kv.layout.block_bytes
    assert counters.blocks_pulled - pulled0 == want_pulled
    assert counters.bytes_pulled - bytes0 == want_pulled * block_bytes
    assert counters.blocks_reused - reused0 == len(h2) - len(lacked)
    assert set(h2) <= set(c.decode.servicer.runner.allocator.cached_hashes())


@pytest.mark.parametrize("length", [5, 2 * BLOCK, 2 * BLOCK + 1, 3 * BLOCK - 1])
async def test_raw_prompts_around_block_edges(cluster: Cluster, length: int) -> None:
    """Shorter than a block (no hash, one partial block), exactly full blocks (no partial
    block), and one token either side."""
    c = cluster
    tokens = [(37 * i + length) % 900 + 50 for i in range(length)]
    params = MultimodalParams()
    sampling = SamplingParams(max_tokens=9, ignore_eos=True)
    e = c.engine
    fresh = Engine(e.config, e.runner.model, e.vision, e.processor, block_size=BLOCK, num_blocks=64)
    seq = fresh.prefill(tokens, params, sampling)
    while seq.finish_reason is None:
        fresh.decode_step([seq])
    reply = await run_prefill(c, tokens, params, sampling)
    assert len(reply.kv.block_hashes) == length // BLOCK
    assert len(reply.kv.blocks) == blocks_for(length, BLOCK)
    answer = await run_decode(c, decode_request(tokens, params, sampling, reply))
    assert answer.token_ids == seq.output
    head = answer.chunks[0]
    assert head.blocks_pulled + head.blocks_reused == blocks_for(length, BLOCK)
