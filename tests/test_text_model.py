"""The language model over paged KV and the mRoPE positions, against the reference.

The reference is `transformers`' Qwen3-VL on a tiny random config. Multimodal rows here are
random tensors (the vision tower is tested elsewhere): both sides get the same rows at the
same placeholder tokens and the same deepstack features, so this pins the LM, the runs ->
rows scattering, deepstack injection and the positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from common.models.qwen3_vl.config import Qwen3VLConfig, TextConfig, VisionConfig
from common.models.qwen3_vl.rope import decode_positions, prompt_positions
from common.models.qwen3_vl.text import TextModel
from common.multimodal.params import ItemEmbedding, Modality, MultimodalItemMetadata
from tests.model_fixtures import kv_buffer

transformers = pytest.importorskip("transformers")

IMG, VID, VS, VE = 500, 501, 502, 503
MERGE = 2
BLOCK = 8


def tiny_config() -> Qwen3VLConfig:
    text = TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        mrope_section=(4, 2, 2),
    )
    vision = VisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        num_position_embeddings=16,
        deepstack_visual_indexes=(0, 1),
    )
    return Qwen3VLConfig(
        text=text,
        vision=vision,
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )


@dataclass
class Case:
    """A prompt with items and random rows, as both sides need it."""

    token_ids: list[int]
    items: list[MultimodalItemMetadata]
    embeddings: dict[int, ItemEmbedding]
    # Reference inputs: token types, grids in payload order per modality.
    image_grids: list[tuple[int, int, int]]
    video_grids: list[tuple[int, int, int]]


def build_case(parts: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> Case:
    """`parts`: ("text", (n,)) | ("image", (h, w)) | ("video", (t, h, w)) in prompt order."""
    g = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    items: list[MultimodalItemMetadata] = []
    embeddings: dict[int, ItemEmbedding] = {}
    image_grids: list[tuple[int, int, int]] = []
    video_grids: list[tuple[int, int, int]] = []

    def text(n: int) -> None:
        tokens.extend(torch.randint(0, 400, (n,), generator=g).tolist())

    for kind, arg in parts:
        if kind == "text":
            text(arg[0])
            continue
        t, h, w = (1, *arg) if kind == "image" else arg
        grid = (t, h, w)
        (image_grids if kind == "image" else video_grids).append(grid)
        per_frame = (h // MERGE) * (w // MERGE)
        runs = []
        for _ in range(t):
            if kind == "video":
                text(3)  # the frame's timestamp
            tokens.append(VS)
            runs.append((len(tokens), per_frame))
            tokens.extend([IMG if kind == "image" else VID] * per_frame)
            tokens.append(VE)
        rows = t * per_frame
        index = len(items)
        items.append(
            MultimodalItemMetadata(
                content_hash=hashlib.sha256(f"{seed}-{index}".encode()).digest(),
                runs=tuple(runs),
                modality=Modality.IMAGE if kind == "image" else Modality.VIDEO,
                grid_thw=grid,
            )
        )
        embeddings[index] = ItemEmbedding(
            rows=torch.randn(rows, 64, generator=g),
            deepstack=(torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)),
        )
    return Case(tokens, items, embeddings, image_grids, video_grids)


CASES: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    "text": [("text", (21,))],
    "image": [("text", (5,)), ("image", (4, 6)), ("text", (7,))],
    "two_images": [
        ("text", (3,)),
        ("image", (4, 4)),
        ("text", (2,)),
        ("image", (6, 4)),
        ("text", (4,)),
    ],
    "video": [("text", (4,)), ("video", (4, 4, 4)), ("text", (5,))],
    # Video before image in the prompt; non-square grids.
    "mixed": [
        ("text", (2,)),
        ("video", (3, 4, 6)),
        ("text", (3,)),
        ("image", (4, 4)),
        ("text", (2,)),
    ],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    config = tiny_config()
    torch.manual_seed(0)
    ref_config = transformers.Qwen3VLConfig.from_dict(config.to_dict())
    ref = transformers.Qwen3VLForConditionalGeneration(ref_config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    folder = tmp_path_factory.mktemp("ckpt")
    ref.save_pretrained(folder)
    from common.models.qwen3_vl.weights import load_weights

    tensors = load_weights(folder, config, prefix=("model.language_model.", "lm_head."))
    return config, ref, TextModel.from_weights(config, tensors)


def ref_positions(ref, case: Case) -> tuple[torch.Tensor, int]:
    ids = torch.tensor([case.token_ids])
    types = torch.zeros_like(ids)
    types[ids == IMG] = 1
    types[ids == VID] = 2
    pos, delta = ref.model.get_rope_index(
        ids,
        types,
        image_grid_thw=torch.tensor(case.image_grids) if case.image_grids else None,
        video_grid_thw=torch.tensor(case.video_grids) if case.video_grids else None,
    )
    return pos[:, 0], int(delta[0, 0])


@torch.no_grad()
def ref_logits(ref, case: Case, extra: Sequence[int] = ()) -> torch.Tensor:
    """Reference logits over the prompt (+ `extra` text tokens after it)."""
    pos, delta = ref_positions(ref, case)
    ids = torch.tensor([case.token_ids + list(extra)])
    n = len(case.token_ids)
    tail = decode_positions(torch.arange(n, n + len(extra)), torch.tensor(delta))
    pos = torch.cat([pos, tail], dim=1).unsqueeze(1)
    lm = ref.model.language_model
    embeds = lm.embed_tokens(ids).clone()
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    index: list[int] = []
    rows, deep0, deep1 = [], [], []
    for i, item in enumerate(case.items):
        for start, length in item.runs:
            index.extend(range(start, start + length))
        rows.append(case.embeddings[i].rows)
        deep0.append(case.embeddings[i].deepstack[0])
        deep1.append(case.embeddings[i].deepstack[1])
    kwargs = {}
    if index:
        embeds[0, index] = torch.cat(rows)
        mask[0, index] = True
        kwargs = {
            "visual_pos_masks": mask,
            "deepstack_visual_embeds": [torch.cat(deep0), torch.cat(deep1)],
        }
    out = lm(inputs_embeds=embeds, position_ids=pos, **kwargs)
    return ref.lm_head(out.last_hidden_state)[0]


def new_kv(model: TextModel, num_blocks: int = 64) -> torch.Tensor:
    return kv_buffer(model.config, num_blocks, BLOCK)


def our_prefill(model: TextModel, case: Case, kv, table, **kw) -> torch.Tensor:
    pos = prompt_positions(len(case.token_ids), case.items, MERGE).positions
    return model.prefill(
        kv,
        table,
        torch.tensor(case.token_ids),
        pos,
        items=case.items,
        embeddings=case.embeddings,
        all_logits=True,
        **kw,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_positions_match_reference(models, name):
    _, ref, _ = models
    case = build_case(CASES[name])
    want, want_delta = ref_positions(ref, case)
    got = prompt_positions(len(case.token_ids), case.items, MERGE)
    assert torch.equal(got.positions, want)
    assert got.delta == want_delta


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_reference(models, name):
    _, ref, model = models
    case = build_case(CASES[name], seed=1)
    table = torch.arange(10, 10 + (len(case.token_ids) + BLOCK - 1) // BLOCK)
    got = our_prefill(model, case, new_kv(model), table)
    want = ref_logits(ref, case)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("chunk", [1, 5, 8, 13])
def test_chunked_prefill_equals_full(models, chunk):
    _, _, model = models
    case = build_case(CASES["mixed"], seed=2)
    table = torch.randperm(40)[: (len(case.token_ids) + BLOCK - 1) // BLOCK]
    full = our_prefill(model, case, new_kv(model), table)
    chunked = our_prefill(model, case, new_kv(model), table, chunk_size=chunk)
    assert (full - chunked).abs().max().item() <= 1e-5


def test_prefill_from_cached_blocks_mid_video(models):
    _, _, model = models
    case = build_case(CASES["video"], seed=3)
    n = len(case.token_ids)
    blocks = (n + BLOCK - 1) // BLOCK
    kv = new_kv(model)
    first = torch.arange(blocks)
    full = our_prefill(model, case, kv, first)
    video = case.items[0]
    start = (video.position + video.length // 2) // BLOCK * BLOCK  # a block boundary mid-video
    assert video.position < start < video.end
    # A second sequence reuses the first's full blocks up to `start`, then owns fresh ones.
    reused = start // BLOCK
    second = torch.cat([first[:reused], torch.arange(40, 40 + blocks - reused)])
    pos = prompt_positions(n, case.items, MERGE).positions
    # Only items overlapping [start, n) need embeddings.
    rest = model.prefill(
        kv,
        second,
        torch.tensor(case.token_ids),
        pos,
        start=start,
        items=case.items,
        embeddings=case.embeddings,
        all_logits=True,
    )
    assert (rest - full[start:]).abs().max().item() <= 1e-5


def test_decode_matches_reference(models):
    _, ref, model = models
    case = build_case(CASES["mixed"], seed=4)
    n = len(case.token_ids)
    table = torch.arange(8)
    kv = new_kv(model)
    prefill = our_prefill(model, case, kv, table)
    delta = prompt_positions(n, case.items, MERGE).delta
    extra: list[int] = [int(prefill[-1].argmax())]
    steps = []
    for i in range(6):
        length = torch.tensor([n + i + 1])
        logits = model.decode(
            kv,
            table.unsqueeze(0),
            torch.tensor(extra[-1:]),
            decode_positions(length - 1, torch.tensor([delta])),
            length,
        )
        steps.append(logits[0])
        extra.append(int(logits[0].argmax()))
    want = ref_logits(ref, case, extra[:-1])[n:]
    assert (torch.stack(steps) - want).abs().max().item() <= 1e-4


def test_kv_lands_at_each_tokens_block_and_offset(models):
    # The model's own writes (prefill, then a decode step reading the blocks; the runner's
    # step with contiguous rows is held by test_packed_prefill's running rows): position
    # p's K/V of every layer at block table[p // BLOCK], slot p % BLOCK, and nothing
    # anywhere else; the same values whichever blocks the table names.
    _, _, model = models
    case = build_case(CASES["text"], seed=7)  # 21 tokens: blocks of 8, 8 and 5
    n = len(case.token_ids)
    kvs = {}
    for table in ([0, 1, 2], [9, 4, 6]):
        kv = new_kv(model, 12)
        our_prefill(model, case, kv, torch.tensor(table))
        length = torch.tensor([n + 1])  # one step: the new token at position n
        pos = decode_positions(length - 1, torch.tensor([0]))
        model.decode(kv, torch.tensor([table]), torch.tensor([7]), pos, length)
        kvs[tuple(table)] = kv
    first, second = kvs[(0, 1, 2)], kvs[(9, 4, 6)]
    written = torch.zeros(second.shape[0], second.shape[3], dtype=torch.bool)
    for p in range(n + 1):
        block, offset = (9, 4, 6)[p // BLOCK], p % BLOCK
        assert second[block, :, :, offset].abs().sum() > 0
        assert torch.equal(second[block, :, :, offset], first[(0, 1, 2)[p // BLOCK], :, :, offset])
        written[block, offset] = True
    assert not second.permute(0, 3, 1, 2, 4, 5)[~written].any()


def test_batched_decode_equals_alone(models):
    _, _, model = models
    lengths = [3, 9, 16, 17, 30, 1, 24, 12]
    g = torch.Generator().manual_seed(5)
    kv = new_kv(model, 64)
    tables = torch.arange(64).view(8, 8)
    tokens = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, 400, (n,), generator=g)
        model.prefill(kv, tables[i], ids, torch.arange(n).expand(3, n))
        tokens.append(int(torch.randint(0, 400, (1,), generator=g)))
    seq_lens = torch.tensor(lengths) + 1
    pos = decode_positions(seq_lens - 1, torch.zeros(8, dtype=torch.long))
    snapshot = kv.clone()
    batched = model.decode(kv, tables, torch.tensor(tokens), pos, seq_lens)
    for i in range(8):
        alone_kv = snapshot.clone()
        alone = model.decode(
            alone_kv,
            tables[i : i + 1],
            torch.tensor(tokens[i : i + 1]),
            pos[:, i : i + 1],
            seq_lens[i : i + 1],
        )
        assert (alone[0] - batched[i]).abs().max().item() <= 1e-5


def test_prefill_needs_only_embeddings_of_uncached_items(models):
    _, _, model = models
    parts = [("video", (2, 4, 4)), ("text", (BLOCK + 3,)), ("image", (4, 4)), ("text", (2,))]
    case = build_case(parts, seed=6)
    n = len(case.token_ids)
    video, img = case.items
    start = -(-video.end // BLOCK) * BLOCK  # first block boundary after the video
    assert start <= img.position
    table = torch.arange((n + BLOCK - 1) // BLOCK)
    kv = new_kv(model)
    full = our_prefill(model, case, kv, table)
    pos = prompt_positions(n, case.items, MERGE).positions
    rest = model.prefill(
        kv,
        table,
        torch.tensor(case.token_ids),
        pos,
        start=start,
        items=case.items,
        embeddings={1: case.embeddings[1]},  # the video lies wholly in the reused prefix
        all_logits=True,
    )
    assert (rest - full[start:]).abs().max().item() <= 1e-5
    with pytest.raises(KeyError):
        model.prefill(kv, table, torch.tensor(case.token_ids), pos, items=case.items)


def test_positions_reject_runs_that_do_not_fit_the_grid():
    item = MultimodalItemMetadata(content_hash=bytes(32), runs=((2, 3),), grid_thw=(1, 4, 4))
    with pytest.raises(ValueError, match="grid_thw"):
        prompt_positions(10, [item], MERGE)
    split = MultimodalItemMetadata(
        content_hash=bytes(32), runs=((1, 2), (5, 2)), grid_thw=(1, 4, 4)
    )
    with pytest.raises(ValueError, match="frame"):
        prompt_positions(10, [split], MERGE)
