"""Where an answer ends on both front doors, through a router whose workers are fakes
(`tests/test_router.py`): stop strings across stream chunks and inside a chunk of several
tokens (the HTTP usage and the gRPC token ids end where a one-token stream's would), and a
stop token's text left out of the answer, as in vLLM.
"""

from __future__ import annotations

import pytest

from common.sampling import SamplingParams
from router.stop import StopStrings
from tests.test_http_api import MODEL_ID, WEATHER, add_workers, api, url_of
from tests.test_http_api import ckpt as ckpt  # fixtures: the module's checkpoint, a router
from tests.test_http_api import fake as fake
from tests.test_router import Cluster as FakeCluster


@pytest.mark.parametrize("size", [1, 2, 3, 100])
def test_stop_strings_are_found_across_chunks(size: int) -> None:
    text = "The cat sat. The END. After"
    cutter = StopStrings(["END", "zzz"])
    out = ""
    for i in range(0, len(text), size):
        out += cutter.add(text[i : i + size])
        if cutter.stopped:
            break
    assert (out, cutter.stopped) == ("The cat sat. The ", True)
    plain = StopStrings(["zz"])
    assert plain.add("fiz") == "fi" and plain.add("") == "" and plain.flush() == "z"


async def test_stop_strings_cut_the_text(fake: FakeCluster) -> None:
    await add_workers(fake)
    client = api(url_of(fake))
    full = await client.chat.completions.create(model=MODEL_ID, messages=WEATHER, max_tokens=8)
    text = full.choices[0].message.content or ""
    assert full.choices[0].finish_reason == "length" and len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = await client.chat.completions.create(
        model=MODEL_ID, messages=WEATHER, max_tokens=8, stop=[stop, "never-there"]
    )
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    pieces = []
    stream = await client.chat.completions.create(
        model=MODEL_ID, messages=WEATHER, max_tokens=8, stop=stop, stream=True
    )
    async for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
    assert "".join(pieces) == text[: text.find(stop)]


async def test_a_stop_tokens_text_is_not_in_the_answer(fake: FakeCluster) -> None:
    # As vLLM's: the token that stopped the answer is in its token ids and counts, and its
    # text is not (it was; include_stop_str_in_output, which would keep it, is refused).
    _, decode = await add_workers(fake)
    decode.first_id = 64  # the tiny tokenizer's "a": the answer goes on "bcdefgh..."
    decode.per_chunk = 3
    full = await fake.client.generate_text(WEATHER, SamplingParams(max_tokens=12))
    assert full.text.endswith("abcdefghijk")
    stop_id = full.token_ids[5]  # "e"
    cut = await fake.client.generate_text(
        WEATHER, SamplingParams(max_tokens=12, stop_token_ids=(stop_id,))
    )
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[:6]
    assert cut.text == full.text[: full.text.index("e")]
    client = api(url_of(fake))
    extra = {"stop_token_ids": [stop_id]}
    reply = await client.chat.completions.create(
        model=MODEL_ID, messages=WEATHER, max_tokens=12, extra_body=extra
    )
    text, usage = reply.choices[0].message.content or "", reply.usage
    assert text == cut.text and usage is not None and usage.completion_tokens == 6
    stream = await client.chat.completions.create(
        model=MODEL_ID,
        messages=WEATHER,
        max_tokens=12,
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text == cut.text and usage is not None and usage.completion_tokens == 6


async def test_a_stop_string_inside_a_chunk_ends_its_tokens_there(fake: FakeCluster) -> None:
    """Decode sends 4 tokens a chunk: the answer's tokens end at the one that completes the
    stop string, as with one token a chunk, in the HTTP usage and the gRPC token ids."""
    _, decode = await add_workers(fake)
    decode.first_id = 64  # the tiny tokenizer's "a": the answer goes on "bcdefgh..."
    twelve = SamplingParams(max_tokens=12)
    full = await fake.client.generate_text(WEATHER, twelve)
    tokens, text = full.token_ids, full.text
    assert text[-11:] == "abcdefghijk"
    k = 8  # a stop string that token 8 ("g", third chunk's second token) completes
    stop = "fg"
    decode.per_chunk = 4
    cut = await fake.client.generate_text(WEATHER, twelve, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    assert cut.token_ids == tokens[:k]
    client = api(url_of(fake))
    reply = await client.chat.completions.create(
        model=MODEL_ID, messages=WEATHER, max_tokens=12, stop=stop
    )
    assert reply.choices[0].message.content == text[: text.find(stop)]
    assert reply.usage is not None and reply.usage.completion_tokens == k
