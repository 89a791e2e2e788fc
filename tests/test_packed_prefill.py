"""Packed prefill and contiguous decode rows compute exactly what one-at-a-time code does.

Packed prefill (`TextModel.prefill_many`, `LmRunner.prefill_many`) runs several prompts' pieces
in one forward; each sequence's K/V and logits must be the ones its own prefill computes (to
float rounding, greedy tokens equal), including prompts with a cached prefix, multimodal
rows and pieces split over forwards.
`RunningKv` keeps contiguous K/V rows for decode; decoding through them must equal decoding
by gathering the paged blocks, across sequences leaving, blocks being reused, and rows
going stale.
"""

from __future__ import annotations

import pytest
import torch

from common.models.qwen3_vl.attention import causal_attention
from common.models.qwen3_vl.prefill_plan import Piece, PrefillRequest, plan_forwards
from common.models.qwen3_vl.rope import decode_positions, prompt_positions
from common.models.runner import LmRunner, PrefillJob
from common.models.tiny import default_checkpoint
from common.multimodal.params import ItemEmbedding, MultimodalItemMetadata, MultimodalParams
from common.sampling import SamplingParams
from tests.model_fixtures import kv_buffer

BLOCK = 4
TOL = 1e-5  # the chunked-vs-whole prefill tolerance of tests/test_text_model.py
EMPTY = MultimodalParams((), {}, 0)


@pytest.fixture(scope="module")
def runner() -> LmRunner:
    return LmRunner.from_pretrained(default_checkpoint("tiny"), block_size=BLOCK, num_blocks=256)


def test_plan_packs_whole_pieces_under_the_budget():
    spans = [(0, 5), (0, 3), (4, 14), (0, 2)]
    # Pieces of at most 4 tokens, aligned from each start; forwards of at most 8 tokens.
    assert plan_forwards(spans, 4, 8) == [
        [Piece(0, 0, 4), Piece(0, 4, 5), Piece(1, 0, 3)],
        [Piece(2, 4, 8), Piece(2, 8, 12)],
        [Piece(2, 12, 14), Piece(3, 0, 2)],
    ]
    # A piece longer than the budget runs alone; no budget and no chunk: one forward.
    assert plan_forwards([(0, 9), (0, 2)], None, 4) == [[Piece(0, 0, 9)], [Piece(1, 0, 2)]]
    assert plan_forwards(spans[:2], None, None) == [[Piece(0, 0, 5), Piece(1, 0, 3)]]
    with pytest.raises(ValueError, match="chunk_size"):
        plan_forwards(spans, 0, None)


def _image_prompt(runner: LmRunner, n_text: int, seed: int) -> tuple[list[int], MultimodalParams]:
    """`n_text` text tokens, a 4x4-patch image (4 rows after merging), 3 more text tokens."""
    config = runner.config
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 400, (n_text + 3,), generator=g).tolist()
    tokens = [*text[:n_text], *[config.image_token_id] * 4, *text[n_text:]]
    item = MultimodalItemMetadata(content_hash=bytes(32), runs=((n_text, 4),), grid_thw=(1, 4, 4))
    hidden = config.text.hidden_size
    depth = len(config.vision.deepstack_visual_indexes)
    rows = torch.randn(4, hidden, generator=g)
    deep = tuple(torch.randn(4, hidden, generator=g) for _ in range(depth))
    return tokens, MultimodalParams((item,), {0: ItemEmbedding(rows, deep)}, 0)


def _requests(runner: LmRunner) -> list[tuple[list[int], MultimodalParams, int]]:
    """(tokens, params, start) of mixed-length prompts; one has a cached prefix of 8 tokens."""
    g = torch.Generator().manual_seed(0)
    out: list[tuple[list[int], MultimodalParams, int]] = []
    for n in (3, 17, 16, 1, 33, 16):
        out.append((torch.randint(0, 400, (n,), generator=g).tolist(), EMPTY, 0))
    out.append((*_image_prompt(runner, 5, 1), 0))
    out.append((torch.randint(0, 400, (21,), generator=g).tolist(), EMPTY, 8))
    return out


def _tables(requests: list[tuple[list[int], MultimodalParams, int]]) -> list[torch.Tensor]:
    tables, next_block = [], 0
    for tokens, _, _ in requests:
        count = -(-len(tokens) // BLOCK)
        tables.append(torch.arange(next_block, next_block + count))
        next_block += count
    return tables


@pytest.mark.parametrize(("chunk", "budget"), [(None, None), (None, 40), (8, 20), (5, 5)])
def test_packed_prefill_equals_each_alone(runner, chunk, budget):
    model = runner.model
    requests = _requests(runner)
    tables = _tables(requests)
    kv = kv_buffer(model.config, 128, BLOCK)
    # The cached prefix of the last prompt: computed into its blocks beforehand.
    tokens, _, start = requests[-1]
    prefix = torch.tensor(tokens)
    model.prefill(kv, tables[-1], prefix[:start], torch.arange(start).expand(3, start))
    alone_kv, packed_kv = kv.clone(), kv.clone()
    batch = []
    alone = []
    for (tokens, params, start), table in zip(requests, tables, strict=True):
        pos = prompt_positions(len(tokens), params.items, 2).positions
        request = PrefillRequest(
            table, torch.tensor(tokens), pos, start, params.items, params.embeddings, True
        )
        batch.append(request)
        alone.append(model.prefill_many(alone_kv, [request], chunk_size=chunk)[0])
    packed = model.prefill_many(packed_kv, batch, chunk_size=chunk, token_budget=budget)
    # Equal up to float rounding: a GEMM's rows may round differently with the row count
    # (one row takes a matrix-vector kernel), never enough to change a greedy token.
    assert (packed_kv - alone_kv).abs().max().item() <= TOL
    for got, want in zip(packed, alone, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= TOL
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(
    ("picks", "chunk", "budget"),
    [
        ((2, 5), None, None),  # equal lengths, fresh: the batched call, last rows only
        ((0, 1, 3, 4, 6, 7), None, None),  # mixed, an image, a cached prefix
        ((0, 1, 3, 4, 6, 7), 8, 20),  # earlier pieces want no rows at all
    ],
)
def test_last_token_logits_equal_the_last_row_of_all_logits(runner, picks, chunk, budget):
    """Without `all_logits` the last layer runs on each prompt's last row only; its logits
    must be the last row of a forward over every row (to rounding, same greedy token), and
    the K/V must be the same."""
    model = runner.model
    requests = [_requests(runner)[i] for i in picks]
    tables = _tables(requests)
    kv = kv_buffer(model.config, 128, BLOCK)
    for (tokens, _, start), table in zip(requests, tables, strict=True):
        if start:  # the cached prefix, computed into its blocks beforehand
            prefix = torch.tensor(tokens[:start])
            model.prefill(kv, table, prefix, torch.arange(start).expand(3, start))
    results = []
    for all_logits in (True, False):
        out_kv = kv.clone()
        batch = [
            PrefillRequest(
                table,
                torch.tensor(tokens),
                prompt_positions(len(tokens), params.items, 2).positions,
                start,
                params.items,
                params.embeddings,
                all_logits,
            )
            for (tokens, params, start), table in zip(requests, tables, strict=True)
        ]
        logits = model.prefill_many(out_kv, batch, chunk_size=chunk, token_budget=budget)
        results.append((out_kv, [t[-1] if all_logits else t for t in logits]))
    (full_kv, full), (last_kv, last) = results
    assert torch.equal(full_kv, last_kv)  # every layer's K/V computed from all rows alike
    for want, got in zip(full, last, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= TOL
        assert int(got.argmax()) == int(want.argmax())


def test_runner_prefill_many_samples_what_prefill_samples(runner):
    requests = _requests(runner)[:-1]  # no cached prefix: blocks are fresh here
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    take = runner.allocator.allocate_prompt
    jobs = []
    alone = []
    for tokens, params, _ in requests:
        blocks = take([], len(tokens) + 4)
        seq = runner.prefill(tokens, params, sampling, blocks=blocks)
        alone.append((seq.output, runner.kv.buffer[blocks].clone()))
        jobs.append((tokens, params, take([], len(tokens) + 4)))
    seqs = runner.prefill_many([PrefillJob(t, p, sampling, b) for t, p, b in jobs])
    for seq, (_, _, blocks), (output, kv) in zip(seqs, jobs, alone, strict=True):
        assert seq.output == output
        assert (runner.kv.buffer[blocks] - kv).abs().max().item() <= TOL
        runner.allocator.release(blocks)


def _decode_both(runner: LmRunner, seqs, steps: int) -> None:
    """Decode `seqs` through the runner (contiguous rows) and check each step's K/V and
    greedy tokens equal a decode that gathers the paged blocks."""
    for _ in range(steps):
        live = [s for s in seqs if s.finish_reason is None]
        snapshot = runner.kv.buffer.clone()
        runner.decode_step(live)
        # The same step by gathering blocks, from the same cache state, in the rows' order.
        lens = torch.tensor([s.num_computed for s in live])
        width = max(len(s.blocks) for s in live)
        tables = torch.zeros(len(live), width, dtype=torch.long)
        for i, s in enumerate(live):
            tables[i, : len(s.blocks)] = torch.tensor(s.blocks)
        deltas = torch.tensor([s.mrope_delta for s in live])
        logits = runner.model.decode(
            snapshot,
            tables,
            torch.tensor([s.output[-2] for s in live]),
            decode_positions(lens - 1, deltas),
            lens,
        )
        # Both wrote the same new K/V (to rounding: the attention spans differ in length).
        assert (snapshot - runner.kv.buffer).abs().max().item() <= TOL
        assert [int(t) for t in logits.argmax(-1)] == [s.output[-1] for s in live]


def test_running_rows_follow_leaving_sequences_and_reused_blocks(runner):
    sampling = [SamplingParams(max_tokens=2 + 3 * i, ignore_eos=True) for i in range(4)]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (6, 13, 1, 20)]
    take = runner.allocator.allocate_prompt
    seqs = [
        runner.prefill(p, EMPTY, s, blocks=take([], len(p) + s.max_tokens))
        for p, s in zip(prompts, sampling, strict=True)
    ]
    loads = runner.running.loads
    _decode_both(runner, seqs, 4)  # the first sequences finish; rows are compacted
    assert runner.running.loads == loads + 4  # each row filled once
    # A finished sequence's blocks go to a new sequence (its K/V overwrite theirs), which
    # joins the running ones.
    done = [s for s in seqs if s.finish_reason is not None]
    assert done
    reused = done[0].blocks
    prompt = torch.randint(0, 400, (9,), generator=g).tolist()
    blocks = reused + take([], 9 + 11 - len(reused) * BLOCK)
    newcomer = runner.prefill(prompt, EMPTY, sampling[-1], blocks=blocks)
    for s in done[1:]:
        runner.allocator.release(s.blocks)
    seqs = [s for s in seqs if s.finish_reason is None] + [newcomer]
    _decode_both(runner, seqs, 3)
    assert runner.running.loads == loads + 5
    # A sequence advanced outside the rows (a decode that gathers blocks) has a stale row:
    # the next step fills it again from the paged cache.
    first = newcomer  # unfinished: 11 tokens to go
    n = torch.tensor([first.num_computed + 1])
    logits = runner.model.decode(
        runner.kv.buffer,
        torch.tensor([first.blocks]),
        torch.tensor([first.output[-1]]),
        decode_positions(n - 1, torch.tensor([first.mrope_delta])),
        n,
    )
    first.output.append(int(logits[0].argmax()))
    _decode_both(runner, seqs, 1)
    assert runner.running.loads == loads + 6
    for s in seqs:
        runner.allocator.release(s.blocks)


def test_decode_without_rows_gathers_blocks_and_agrees(runner):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (5, 18, 11)]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = []
    for contiguous in (True, False):
        runner.contiguous_decode = contiguous
        try:
            seqs = [
                runner.prefill(
                    p, EMPTY, sampling, blocks=runner.allocator.allocate_prompt([], 11 + len(p))
                )
                for p in prompts
            ]
            for _ in range(5):
                runner.decode_step(seqs)
        finally:
            runner.contiguous_decode = True
        outputs.append([s.output for s in seqs])
        for s in seqs:
            runner.allocator.release(s.blocks)
    assert outputs[0] == outputs[1]
    assert all(len(out) == 6 for out in outputs[0])


def test_rows_past_their_memory_budget_gather_blocks_and_the_buffer_shrinks(runner, monkeypatch):
    # Rows are batch x the longest sequence: one long sequence among short ones reserved its
    # length for every row, many times the whole pool, and kept it after it left.
    g = torch.Generator().manual_seed(5)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)

    def run(lengths: list[int]) -> list[list[int]]:
        prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in lengths]
        seqs = [
            runner.prefill(p, EMPTY, sampling, blocks=runner.allocator.allocate_prompt([], 4 + n))
            for p, n in zip(prompts, lengths, strict=True)
        ]
        for _ in range(3):
            runner.decode_step(seqs)
        for s in seqs:
            runner.allocator.release(s.blocks)
        return [s.output for s in seqs]

    runner.running.clear()
    monkeypatch.setattr(runner.running, "budget", 3 * 1024)  # three rows of 1024 fit
    state = g.get_state()
    with_rows = run([600, 5, 9])
    assert runner.running.buffer.shape[4] == 1024  # 600 tokens: 1024 slots a row
    run([5, 9])
    assert runner.running.buffer.shape[4] == 256  # four times too large: cut down
    monkeypatch.setattr(runner.running, "budget", 3 * 1024 - 1)  # three rows of 1024 pass it
    loads = runner.running.loads
    g.set_state(state)
    assert run([600, 5, 9]) == with_rows  # the same answers, from gathered blocks
    assert runner.running.loads == loads and runner.running.buffer.shape[0] == 0


def test_a_batch_within_the_budget_loads_each_row_once(runner, monkeypatch):
    # Growth doubled the rows past the budget: from half the budget on, each join cleared
    # the rows (a gathered step) and the next step loaded every sequence again.
    runner.running.clear()
    monkeypatch.setattr(runner.running, "budget", 12 * 256)  # 12 rows of 256 slots
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    seqs = []
    loads = []
    for _ in range(12):
        blocks = runner.allocator.allocate_prompt([], 24)
        seqs.append(runner.prefill(list(range(1, 9)), EMPTY, sampling, blocks=blocks))
        before = runner.running.loads
        runner.decode_step(seqs)
        loads.append(runner.running.loads - before)
    assert loads == [1] * 12  # only the sequence that joined
    for s in seqs:
        runner.allocator.release(s.blocks)
    runner.running.clear()


def test_rows_past_a_sequences_length_hold_no_garbage(runner, monkeypatch):
    """Attention masks a shorter row's tail, but a masked NaN still poisons the weighted sum
    (0 * NaN): the rows' buffer must be allocated zeroed. Poison every allocation the
    buffer could come from and decode sequences of different lengths."""
    original = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        return original(self, *args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    runner.running.clear()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (3, 17, 9)]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [
        runner.prefill(p, EMPTY, sampling, blocks=runner.allocator.allocate_prompt([], 4 + len(p)))
        for p in prompts
    ]
    try:
        for _ in range(3):
            runner.decode_step(seqs)
        assert torch.isfinite(runner.running.buffer).all()
    finally:
        monkeypatch.undo()
        runner.running.clear()
    alone = []
    for p in prompts:
        blocks = runner.allocator.allocate_prompt([], 4 + len(p))
        seq = runner.prefill(p, EMPTY, sampling, blocks=blocks)
        for _ in range(3):
            runner.decode_step([seq])
        alone.append(seq.output)
        runner.allocator.release(blocks)
    assert [s.output for s in seqs] == alone
    for s in seqs:
        runner.allocator.release(s.blocks)


def test_decode_without_a_block_for_the_next_token_names_its_position(runner):
    prompt = list(range(1, 2 * BLOCK + 1))  # fills its two blocks exactly
    blocks = runner.allocator.allocate_prompt([], len(prompt))
    seq = runner.prefill(
        prompt, EMPTY, SamplingParams(max_tokens=4, ignore_eos=True), blocks=blocks
    )
    with pytest.raises(ValueError, match=f"position {2 * BLOCK}"):
        runner.decode_step([seq])
    runner.allocator.release(blocks)


@pytest.mark.parametrize("n", [200, 257, 384, 512, 600])
def test_causal_attention_in_two_calls_equals_one_causal_call(n):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(2, 4, n, 8, generator=g)
    k, v = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    got = causal_attention(q, k, v)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-6
