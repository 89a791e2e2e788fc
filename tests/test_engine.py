"""The offline engine on a tiny random checkpoint, against the reference `transformers` model.

Both sides read the same checkpoint folder; the reference gets our processor's outputs
(token ids, patch rows and grids have the reference's layout), so the comparison covers the
vision tower, the scattering of rows at exact runs, deepstack, mRoPE and the LM.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from common.engine import Engine
from common.kv.hashing import block_hashes
from common.models import batching
from common.models.tiny import make_tiny_checkpoint
from common.multimodal.params import Modality, MultimodalParams
from common.processing.processor import ProcessedPrompt
from common.sampling import SamplingParams
from tests.model_fixtures import image, user, video

transformers = pytest.importorskip("transformers")

BLOCK = 8


def img_part(seed: int, w: int = 64, h: int = 48) -> dict[str, Any]:
    return {"type": "image", "image": image(seed, w, h)}


def vid_part(seed: int, frames: int = 8) -> dict[str, Any]:
    return {"type": "video", "video": video(seed, frames), "fps": 2.0}


CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "text": (user("Describe the weather in the city today."), {}),
    "image": (user(img_part(1), "What is in this image?"), {}),
    "two_images": (user(img_part(1), "and", img_part(2, 32, 96), "Compare them."), {}),
    "video": (user("Watch:", vid_part(3), "What happens?"), {}),
    # Video first, then the images in the reverse of their payload order.
    "mixed": (
        user(
            vid_part(4, 6),
            "then",
            {"type": "image", "index": 1},
            "and",
            {"type": "image", "index": 0},
            "Explain.",
        ),
        {"images": [image(5, 64, 64), image(6, 96, 32)]},
    ),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)
    engine = Engine.from_pretrained(folder, block_size=BLOCK, num_blocks=256, max_batch=8)
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder).eval()
    return engine, ref


def fresh(engine: Engine, **kw: Any) -> Engine:
    """A new engine (own KV cache and pool) sharing the loaded weights."""
    args = {"block_size": BLOCK, "num_blocks": 256, "max_batch": 8, **kw}
    return Engine(engine.config, engine.runner.model, engine.vision, engine.processor, **args)


def ref_inputs(engine: Engine, p: ProcessedPrompt) -> dict[str, torch.Tensor]:
    ids = torch.tensor([p.prompt_token_ids])
    types = torch.zeros_like(ids)
    types[ids == engine.config.image_token_id] = 1
    types[ids == engine.config.video_token_id] = 2
    out = {"input_ids": ids, "mm_token_type_ids": types, "attention_mask": torch.ones_like(ids)}
    for modality, pixels, grids in (
        (Modality.IMAGE, "pixel_values", "image_grid_thw"),
        (Modality.VIDEO, "pixel_values_videos", "video_grid_thw"),
    ):
        chosen = [i for i, it in enumerate(p.params.items) if it.modality == modality]
        if chosen:
            out[pixels] = p.vision_inputs(chosen)[0]  # float32 values
            out[grids] = torch.tensor([p.grid_thw[i] for i in chosen])
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_positions_match_reference(setup, name):
    engine, ref = setup
    messages, side = CASES[name]
    p = engine.process(messages, **side)
    inputs = ref_inputs(engine, p)
    want, delta = ref.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
    )
    got = engine.positions(p.prompt_token_ids, p.params)
    assert torch.equal(got.positions, want[:, 0])
    assert got.delta == int(delta[0, 0])
    if name == "video":
        assert len(p.params.items[0].runs) >= 4  # one run per temporal patch


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logits_match_reference(setup, name):
    engine, ref = setup
    messages, side = CASES[name]
    got = engine.prompt_logits(messages, **side)
    with torch.no_grad():
        want = ref(**ref_inputs(engine, engine.process(messages, **side))).logits[0]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["image", "mixed"])
def test_greedy_generation_matches_reference(setup, name):
    engine, ref = setup
    messages, side = CASES[name]
    p = engine.process(messages, **side)
    params = engine.encode(p)
    seq = engine.prefill(p.prompt_token_ids, params, SamplingParams(max_tokens=16, ignore_eos=True))
    while seq.finish_reason is None:
        engine.decode_step([seq])
    engine.release(seq)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(**ref_inputs(engine, p), max_new_tokens=16, do_sample=False)
    assert seq.output == out[0, len(p.prompt_token_ids) :].tolist()
    assert len(seq.output) == 16


def test_prefill_reuses_cached_blocks_ending_mid_video(setup):
    engine = fresh(setup[0], num_blocks=64)
    first = engine.process(user("Watch this:", vid_part(7), "What happens first?"))
    seq = engine.prefill(first.prompt_token_ids, engine.encode(first), SamplingParams(max_tokens=1))
    engine.release(seq)
    video_item = first.params.items[0]
    keep = (video_item.position + video_item.length // 2) // BLOCK  # blocks to keep cached
    assert video_item.position < keep * BLOCK < video_item.end
    # Evict the cached tail (LRU drops a released sequence's last blocks first).
    pool = engine.runner.allocator.pool
    only_free = pool.num_free_blocks - pool.num_evictable_blocks
    pool.release(pool.allocate(only_free + pool.num_cached_blocks - keep))
    assert pool.num_cached_blocks == keep

    second_messages = user("Watch this:", vid_part(7), "And what happens at the end?")
    second = engine.process(second_messages)
    hashes = block_hashes(second.prompt_token_ids, BLOCK, second.params)
    assert hashes[:keep] == block_hashes(first.prompt_token_ids, BLOCK, first.params)[:keep]
    assert len(pool.find_cached_prefix(hashes)) == keep
    seq = engine.prefill(
        second.prompt_token_ids,
        engine.encode(second),
        SamplingParams(max_tokens=1),
        keep_logits=True,
    )
    engine.release(seq)
    assert seq.cached_tokens == keep * BLOCK
    full = engine.prompt_logits(second_messages)
    assert seq.prompt_logits is not None
    assert (seq.prompt_logits - full[keep * BLOCK :]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("chunk", [3, 8, 29])
def test_chunked_prefill_equals_full(setup, chunk):
    engine = setup[0]
    messages, side = CASES["mixed"]
    full = engine.prompt_logits(messages, **side)
    chunked = fresh(engine, prefill_chunk=chunk).prompt_logits(messages, **side)
    assert (full - chunked).abs().max().item() <= 1e-5


def prompts(n: int) -> list[list[dict[str, Any]]]:
    text = "one two three four five six seven eight nine ten eleven twelve"
    words = text.split(" ")
    out = [user(" ".join(words[: 1 + 3 * i % 12]) * (1 + i % 3)) for i in range(n)]
    out[2] = user(img_part(8), "Say something.")
    out[5] = user("Look:", vid_part(9, 4), "Now?")
    return out


def test_batched_decode_equals_each_alone(setup):
    engine = fresh(setup[0])
    requests = prompts(8)
    sampling = [
        SamplingParams(max_tokens=6 + i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
        for i in range(8)
    ]
    lengths = {len(engine.process(m).prompt_token_ids) for m in requests}
    assert len(lengths) >= 6  # different lengths
    batched = engine.generate_batch(requests, sampling)
    alone = [fresh(setup[0]).generate(m, s) for m, s in zip(requests, sampling, strict=True)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [len(r.token_ids) for r in batched] == [6 + i for i in range(8)]
    assert engine.runner.allocator.pool.num_used_blocks == 0
    engine.runner.allocator.pool.check_invariants()


def test_continuous_batching_admits_when_blocks_free(setup):
    # Room for about two requests at a time: the rest wait for released blocks.
    engine = fresh(setup[0], num_blocks=12, max_batch=8)
    pool = prompts(8)
    # Repeated prompts reuse the first one's cached blocks.
    requests = [pool[0], pool[1], pool[2], pool[0], pool[3], pool[1]]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    need = [-(-(len(engine.process(m).prompt_token_ids) + 4) // BLOCK) for m in requests]
    assert max(need) <= 12 < sum(need)
    results = engine.generate_batch(requests, sampling)
    want = [fresh(setup[0]).generate(m, sampling) for m in requests]
    assert [r.token_ids for r in results] == [r.token_ids for r in want]
    assert engine.runner.allocator.pool.num_used_blocks == 0
    assert results[3].cached_tokens > 0


def test_a_stop_tokens_text_is_left_out_as_the_router_leaves_it_out(setup):
    # The engine, the reference the deployment is checked against, showed it (sampling
    # review L1, s44): same tokens, different text.
    engine = setup[0]
    messages, _ = CASES["text"]
    free = engine.generate(messages, SamplingParams(max_tokens=6, ignore_eos=True))
    stop = free.token_ids[3]
    special = set(engine.processor.tokenizer.get_added_tokens_decoder())
    assert stop not in special  # a word piece: its text would show
    stopped = engine.generate(
        messages, SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=(stop,))
    )
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    kept = [t for t in stopped.token_ids if t != stop]
    assert (
        stopped.text == engine.processor.decode(kept) != engine.processor.decode(stopped.token_ids)
    )


def test_repeated_prompt_hits_prefix_cache(setup):
    engine = fresh(setup[0])
    messages, _ = CASES["image"]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    first = engine.generate(messages, sampling)
    again = engine.generate(messages, sampling)
    assert first.cached_tokens == 0
    n = first.prompt_tokens
    assert again.cached_tokens == (n - 1) // BLOCK * BLOCK
    assert again.token_ids == first.token_ids
    assert isinstance(again.text, str)


def test_batch_step_releases_finished_and_cancelled_sequences(setup):
    engine = fresh(setup[0])
    pool = engine.runner.allocator.pool
    p = engine.process(CASES["text"][0])
    params = engine.encode(p)

    def admit(max_tokens: int):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return engine.prefill(p.prompt_token_ids, params, sampling)

    short, long, gone = admit(2), admit(50), admit(50)
    batch = batching.Batch(engine.runner)
    for seq in (short, long, gone):
        batch.add(seq)
    batch.cancel(gone)
    # `short` ends at its second token; `gone` is dropped without being decoded again.
    assert batch.step() == [short, gone]
    assert short.blocks == [] and gone.blocks == [] and len(gone.output) == 1
    assert batch.running == [long] and len(long.output) == 2 and batch.steps == 1
    assert pool.num_used_blocks == len(long.blocks)
    batch.release_all()
    assert pool.num_used_blocks == 0 and batch.running == []
    pool.check_invariants()


@pytest.mark.parametrize("where", ["process", "step"])
def test_generate_batch_failure_releases_every_block(setup, monkeypatch, where):
    """A failure while requests are running (a later malformed chat, a step that raises)
    gives back the running sequences' blocks too, not only those admitted in that round:
    the pool is all free afterwards and the engine serves the next batch."""
    engine = fresh(setup[0], num_blocks=64, max_batch=2)
    pool = engine.runner.allocator.pool
    ok = CASES["text"][0]
    requests = [ok, ok, [{"role": "nonsense-role", "content": 42}]]
    sampling = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 30, 2)]
    if where == "step":
        requests = requests[:2]
        sampling = sampling[:2]
        real = engine.runner.decode_step
        calls = 0

        def flaky(seqs):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise MemoryError("no room to grow the running KV")
            real(seqs)

        monkeypatch.setattr(engine.runner, "decode_step", flaky)
    with pytest.raises(ValueError if where == "process" else MemoryError):
        engine.generate_batch(requests, sampling)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()
    monkeypatch.undo()
    want = fresh(setup[0]).generate(ok, sampling[1])
    assert engine.generate(ok, sampling[1]).token_ids == want.token_ids


@pytest.mark.parametrize("max_batch", [0, -1])
def test_a_batch_of_no_sequences_is_refused_when_built(setup, max_batch):
    # It admitted nothing and `generate` looped for ever.
    engine, _ = setup
    with pytest.raises(ValueError, match="max_batch"):
        fresh(engine, max_batch=max_batch)


def test_a_request_past_the_context_or_the_pool_is_refused_naming_it(setup):
    # A deployment refuses both; the engine generated past the context silently, and a
    # request larger than its pool failed the whole batch after the others had decoded.
    engine, _ = setup
    small = fresh(engine, num_blocks=8)  # 8 x BLOCK tokens
    ok = user("Hello there.")
    context = engine.config.text.max_position_embeddings
    with pytest.raises(ValueError, match=r"request 1: .*context"):
        small.generate_batch(
            [ok, ok], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=context)]
        )
    with pytest.raises(ValueError, match=r"request 0: .*KV blocks; the pool has 8"):
        small.generate_batch([ok], SamplingParams(max_tokens=8 * BLOCK))
    # Refused before any other request's work, however late in the batch it comes.
    one = fresh(engine, num_blocks=8, max_batch=1)
    steps = []
    one.runner.decode_step = lambda seqs: steps.append(seqs)
    with pytest.raises(ValueError, match="request 2: "):
        one.generate_batch(
            [ok, ok, ok],
            [SamplingParams(max_tokens=2)] * 2 + [SamplingParams(max_tokens=8 * BLOCK)],
        )
    assert steps == []
    assert small.runner.allocator.pool.num_free_blocks == 8  # nothing kept
    assert small.generate(ok, SamplingParams(max_tokens=3)).finish_reason == "length"


def test_a_pool_that_holds_every_slot_a_request_writes_serves_it(setup):
    # The engine took a slot for the last sampled token too, which is never fed back: a
    # pool that held the request whole refused it whenever prompt + max_tokens was one past
    # a block boundary (the workers and the router count it as here).
    engine, _ = setup
    ok = user("Hello there.")
    n = len(engine.process(ok).prompt_token_ids)
    max_tokens = BLOCK - (n % BLOCK) + 1 + BLOCK  # n + max_tokens one past a boundary
    exact = fresh(engine, num_blocks=(n + max_tokens - 1) // BLOCK)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    got = exact.generate(ok, sampling)
    assert got.token_ids == fresh(engine).generate(ok, sampling).token_ids
    assert exact.runner.allocator.pool.num_used_blocks == 0


def test_prefix_cache_hits_count_the_blocks_reused(setup):
    # Hits were counted before the prefix was cut to keep the last token computed and before
    # blocks whose bytes changed were dropped: a 16-token prompt seen twice reused 1 block of
    # 8 and counted 2 hits (and the router's cache-aware figures and `epd status` with it).
    engine = fresh(setup[0], num_blocks=64)
    pool = engine.runner.allocator.pool
    tokens = list(range(100, 100 + 2 * BLOCK))
    for attempt in range(2):
        before = (pool.lookups, pool.hits)
        seq = engine.prefill(tokens, MultimodalParams((), {}, 0), SamplingParams(max_tokens=1))
        assert seq.cached_tokens == attempt * BLOCK
        assert (pool.lookups - before[0], pool.hits - before[1]) == (2, attempt)
        engine.release(seq)
