"""SamplingParams validation, the batch Sampler, and the stop rule."""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling import (
    GREEDY_TEMPERATURE,
    Sampler,
    SamplingError,
    SamplingParams,
    StopChecker,
    apply_top_k_top_p,
    draw_seed,
    finish_reason,
)

VOCAB = 64


def rand_logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample_steps(
    logits_rows: torch.Tensor, params: SamplingParams, steps: int, start: int = 0
) -> list[int]:
    """Tokens a seeded request draws at positions start, start+1, ..., alone in the batch."""
    return [
        int(Sampler().sample(logits_rows[None], [params], [start + p])[0]) for p in range(steps)
    ]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_params_defaults_and_normalization():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4) and p.is_greedy
    assert SamplingParams(temperature=1.0, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_greedy_is_argmax():
    logits = rand_logits(5)
    out = Sampler().sample(logits, [SamplingParams()] * 5, [0] * 5)
    assert out.dtype == torch.long
    assert torch.equal(out, logits.argmax(dim=-1))


def test_temperature_and_top_p_are_the_float32_the_wire_carries():
    # 1e-5 was sampled offline and greedy once deployed (the wire's float32 is below 1e-5);
    # 1e39 and top_p 1e-50 passed here to be refused by the router as "inf" and "0.0",
    # values the client never sent; a list-less stop_token_ids was a bare TypeError
    # (sampling review L4, L5, s44).
    from common.wire.sampling import sampling_from_proto, sampling_to_proto

    for params in (SamplingParams(temperature=1e-5), SamplingParams(temperature=0.7, top_p=0.9)):
        sent = sampling_from_proto(sampling_to_proto(params))
        assert (sent.temperature, sent.top_p, sent.is_greedy) == (
            params.temperature,
            params.top_p,
            params.is_greedy,
        )
    assert not SamplingParams(temperature=1e-5).is_greedy
    refused = [("temperature", 1e39), ("top_p", 1e-50), ("stop_token_ids", 5)]
    refused += [("temperature", -1e-46), ("top_p", 1.0000000001)]  # float32 -0.0 and 1.0
    refused += [("temperature", 10**400)]  # a struct.error, named nowhere (ownfixC L4)
    for field, bad in refused:
        with pytest.raises(SamplingError) as err:
            SamplingParams(**{field: bad})
        assert err.value.field == field and repr(bad) in str(err.value)


def test_top_k_one_is_greedy_even_when_hot():
    logits = rand_logits(4)
    params = [SamplingParams(temperature=5.0, top_k=1, seed=i) for i in range(4)]
    for p in range(3):
        assert torch.equal(Sampler().sample(logits, params, [p] * 4), logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-38, 1e-46, 1e-300])
def test_a_tiny_temperature_is_greedy(temperature):
    """Below `GREEDY_TEMPERATURE` a row takes the argmax, seeded or not: dividing the logits
    by such a temperature overflowed to NaN probabilities, and the draw picked token 0."""
    logits = torch.tensor([[1.0, 5.0, 2.0, -3.0], [-1e4, 3.0, 2.999, 1e4]])
    params = [
        SamplingParams(temperature=temperature, seed=0),
        SamplingParams(temperature=temperature),
    ]
    assert all(p.is_greedy for p in params)
    for position in range(10):
        assert Sampler().sample(logits, params, [position] * 2).tolist() == [1, 3]
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy


def test_seeded_sampling_is_reproducible_and_batch_invariant():
    logits = rand_logits(4, seed=1)
    params = [
        SamplingParams(temperature=1.3, seed=11),
        SamplingParams(),  # greedy neighbour
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=12),
        SamplingParams(temperature=2.0, seed=13),
    ]
    steps = 12
    alone = [sample_steps(logits[i], p, steps) for i, p in enumerate(params)]
    assert alone == [sample_steps(logits[i], p, steps) for i, p in enumerate(params)]
    batched = [Sampler().sample(logits, params, [p] * 4).tolist() for p in range(steps)]
    assert [list(col) for col in zip(*batched, strict=True)] == alone
    assert len(set(alone[0])) > 1  # it really samples
    # Another batch order / composition gives the same per-request tokens.
    swapped = [
        Sampler().sample(logits[[3, 0]], [params[3], params[0]], [p, p]).tolist()
        for p in range(steps)
    ]
    assert [row[0] for row in swapped] == alone[3]
    assert [row[1] for row in swapped] == alone[0]


def test_different_seeds_differ():
    logits = rand_logits(1)[0]
    a = sample_steps(logits, SamplingParams(temperature=2.0, seed=1), 20)
    b = sample_steps(logits, SamplingParams(temperature=2.0, seed=2), 20)
    assert a != b


def test_a_draw_is_a_function_of_seed_and_position_only():
    logits = rand_logits(1, seed=3)[0]
    params = SamplingParams(temperature=1.5, seed=5)
    whole = sample_steps(logits, params, 16)
    # Resumed mid-way (a fresh process, say): positions 9.. draw what they drew before,
    # whatever was sampled in between and in whatever order.
    assert sample_steps(logits, params, 7, start=9) == whole[9:]
    assert [sample_steps(logits, params, 1, start=p)[0] for p in reversed(range(16))] == (
        whole[::-1]
    )
    # Canonical and distinct per position.
    assert draw_seed(5, 9) == draw_seed(5, 9) != draw_seed(5, 10) != draw_seed(6, 9)
    assert 0 <= draw_seed(2**63 - 1, 2**40) < 2**63
    with pytest.raises(ValueError, match="position"):
        draw_seed(5, -1)


def test_sampled_tokens_respect_top_k():
    logits = rand_logits(1)[0]
    top3 = set(logits.topk(3).indices.tolist())
    drawn = sample_steps(logits, SamplingParams(temperature=10.0, top_k=3, seed=0), 200)
    assert set(drawn) == top3


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4000)]
    counts = torch.bincount(Sampler().sample(logits, params, [7] * 4000), minlength=3) / 4000
    assert torch.allclose(counts, probs, atol=0.03)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    # Token ids shuffled against rank: probabilities 0.15, 0.5, 0.05, 0.3 for ids 0..3.
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    by_rank = [1, 3, 0, 2]
    want = {by_rank[r] for r in kept}
    out = apply_top_k_top_p(probs.log()[None], torch.tensor([0]), torch.tensor([top_p]))
    assert {i for i in range(4) if out[0, i] > -math.inf} == want


def test_top_k_then_top_p_renormalizes():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # After top_k=2 the kept probs are 4/7 and 3/7; top_p=0.5 then keeps only the first.
    out = apply_top_k_top_p(probs.log(), torch.tensor([2]), torch.tensor([0.5]))
    assert (out[0] > -math.inf).tolist() == [True, False, False, False]
    out = apply_top_k_top_p(probs.log(), torch.tensor([3]), torch.tensor([1.0]))
    assert (out[0] > -math.inf).tolist() == [True, True, True, False]
    assert torch.equal(out[0, :3], probs.log()[0, :3])


def test_sample_checks_shapes():
    with pytest.raises(ValueError, match="params"):
        Sampler().sample(rand_logits(2), [SamplingParams()], [0, 0])


def test_finish_reason():
    p = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert finish_reason(p, 5, 1, eos_token_ids={2}) is None
    assert finish_reason(p, 9, 1, eos_token_ids={2}) == "stop"
    assert finish_reason(p, 2, 1, eos_token_ids={2}) == "stop"
    assert finish_reason(p, 2, 3, eos_token_ids={2}) == "stop"  # stop wins over length
    assert finish_reason(p, 5, 3, eos_token_ids={2}) == "length"
    ignore = SamplingParams(max_tokens=3, ignore_eos=True)
    assert finish_reason(ignore, 2, 1, eos_token_ids={2}) is None
    checker = StopChecker(frozenset({2, 7}))
    assert checker.check(p, 7, 1) == "stop"
    assert checker.check(ignore, 7, 3) == "length"


# ------------------------------------------------- through the runner: alone, batch, resumed


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from common.engine import Engine
    from common.models.tiny import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)
    # One torch thread: on a shared machine oversubscribed intra-op threads run far slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_pretrained(folder, block_size=8, num_blocks=128, max_batch=4)
    torch.set_num_threads(threads)


def _chat(text: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def _image_chat() -> list[dict[str, object]]:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    part = {"type": "image", "image": Image.fromarray(pixels)}
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]


@pytest.mark.parametrize("chat", ["text", "image"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.2, "top_p": 0.95, "seed": 7}])
def test_seeded_tokens_alone_batched_and_resumed(engine, chat, sampling):
    """A request's tokens are the same decoded alone, beside others, or resumed mid-way
    from its prompt's KV plus its tokens so far (`LmRunner.resume`, what a decode worker
    does when it takes over a broken stream)."""
    messages = _chat("Tell me a story about a cat.") if chat == "text" else _image_chat()
    params = SamplingParams(max_tokens=10, ignore_eos=True, **sampling)
    alone = engine.generate(messages, params).token_ids
    others = [_chat("Other request"), _chat("And one more, longer than the others.")]
    other_params = [SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.9, seed=3)] * 2
    batched = engine.generate_batch([*others, messages], [*other_params, params])
    assert batched[2].token_ids == alone
    if sampling:
        assert len(set(alone)) > 2  # it really samples
    prompt = engine.process(messages)
    encoded = engine.encode(prompt)
    for cut in (1, 7):
        # A fresh prefill gives the prompt's KV; the tokens after it are recomputed.
        seq = engine.prefill(prompt.prompt_token_ids, encoded, params, use_prefix_cache=False)
        resumed = engine.runner.resume(
            prompt.prompt_token_ids,
            params,
            seq.blocks,
            alone[:cut],
            mrope_delta=seq.mrope_delta,
        )
        while resumed.finish_reason is None:
            engine.decode_step([resumed])
        assert resumed.output == alone, cut
        engine.release(resumed)
