"""The router's OpenAI-compatible HTTP API against one real deployment for the module.

The deployment is `tests.cluster`'s, with its HTTP API, driven with the `openai` client. Pins:
streamed answers equal the gRPC front door's (an image, an mp4 data URL), usage and cached
tokens on a prompt asked again, and the models, completions, metrics and health endpoints.
"""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.processing.processor import Processor
from common.sampling import SamplingParams
from epd.client import Client
from tests.cluster import Cluster, start_cluster
from tests.test_http_api import MODEL_ID, api, png_data_url, user, wait_health
from tests.test_http_api import ckpt as ckpt  # fixture
from tests.test_video_file import make_video


@pytest.fixture(scope="module")
def deployment(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = start_cluster(
        ckpt,
        tmp_path_factory.mktemp("http-logs"),
        http=True,
        router_args=("--served-model-name", MODEL_ID),
    )
    try:
        yield cluster
    finally:
        cluster.stop()


IMAGE_CHAT = user(
    {"type": "image_url", "image_url": {"url": png_data_url(3)}},
    {"type": "text", "text": "What is in the picture?"},
)
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


async def test_streamed_chat_equals_the_grpc_answer(deployment: Cluster) -> None:
    assert deployment.http_url is not None
    client = api(deployment.http_url)
    stream = await client.chat.completions.create(
        model=MODEL_ID,
        messages=IMAGE_CHAT,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    pieces, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    image = base64.b64decode(png_data_url(3).split(",", 1)[1])
    grpc_chat = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    async with Client(deployment.address, api_key=deployment.client_key) as grpc_client:
        expected = await grpc_client.generate_text(
            grpc_chat, SamplingParams(max_tokens=6, ignore_eos=True)
        )
    assert "".join(pieces) == expected.text
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens == expected.prompt_tokens > 0


async def test_usage_reports_cached_tokens_when_asked_again(deployment: Cluster) -> None:
    assert deployment.http_url is not None
    client = api(deployment.http_url)
    chat = user(
        {"type": "image_url", "image_url": {"url": png_data_url(9)}},
        {"type": "text", "text": "Once more, describe it."},
    )
    first = await client.chat.completions.create(model=MODEL_ID, messages=chat, **GREEDY)
    again = await client.chat.completions.create(model=MODEL_ID, messages=chat, **GREEDY)
    assert first.usage is not None and again.usage is not None
    assert first.usage.total_tokens == first.usage.prompt_tokens + 6
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content


async def test_a_cache_salt_in_the_body_splits_the_cache(deployment: Cluster) -> None:
    """`cache_salt` (vLLM's extension) is the gRPC field's: two end users behind one key,
    each with a salt of their own, do not see each other's prompts in `cached_tokens`."""
    assert deployment.http_url is not None
    client = api(deployment.http_url)
    chat = user({"type": "text", "text": "A long shared system prompt, " * 8})

    async def cached(salt: str | None) -> int:
        extra = {"ignore_eos": True, **({"cache_salt": salt} if salt else {})}
        done = await client.chat.completions.create(
            model=MODEL_ID, messages=chat, temperature=0, max_tokens=2, extra_body=extra
        )
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        return done.usage.prompt_tokens_details.cached_tokens or 0

    assert await cached("end-user-1") == 0
    assert await cached("end-user-2") == 0  # not end-user-1's blocks
    assert await cached("end-user-1") > 0
    assert await cached(None) == 0  # the tenant's own cache, unsplit, is another


async def test_tenants_over_http_never_share_cached_blocks(deployment: Cluster) -> None:
    # Each key's tenant salts the caches over HTTP as over gRPC: with every HTTP caller
    # given one tenant, every test here passed all the same (invariants review).
    assert deployment.http_url is not None
    chat = user({"type": "text", "text": "Zebras! A long prompt two tenants both send, " * 8})

    async def cached(key: str) -> int:
        done = await api(deployment.http_url or "", key).chat.completions.create(
            model=MODEL_ID, messages=chat, **{**GREEDY, "max_tokens": 2}
        )
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        return done.usage.prompt_tokens_details.cached_tokens or 0

    assert await cached(deployment.client_key) == 0
    assert await cached(deployment.other_key) == 0  # not tenant-a's blocks
    assert await cached(deployment.client_key) > 0
    assert await cached(deployment.other_key) > 0  # its own, now


async def test_models_completions_and_health(deployment: Cluster) -> None:
    assert deployment.http_url is not None
    client = api(deployment.http_url)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    done = await client.completions.create(
        model=MODEL_ID, prompt="Once upon a time", temperature=0, max_tokens=4
    )
    assert done.usage is not None and done.usage.completion_tokens <= 4
    assert done.choices[0].finish_reason in ("length", "stop")
    # The prompt is tokenized as it is: no chat template around it.
    plain = Processor.from_pretrained(deployment.model).process_text("Once upon a time")
    assert done.usage.prompt_tokens == len(plain.prompt_token_ids)
    # The router's Prometheus metrics are on the API port too, for an admin key (the page
    # shows every tenant's traffic), and count the requests.
    page = f"{deployment.http_url}/metrics"
    for key, status in ((None, 401), (deployment.client_key, 403)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(page, headers=headers), timeout=10)
        assert refused.value.code == status
    admin = urllib.request.Request(
        page, headers={"Authorization": f"Bearer {deployment.admin_key}"}
    )
    with urllib.request.urlopen(admin, timeout=10) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    e2e = families["vllm:e2e_request_latency_seconds"]
    assert next(s.value for s in e2e.samples if s.name.endswith("_count")) >= 1
    await wait_health(deployment.http_url, 200)


async def test_an_mp4_data_url_streams_the_answer_to_its_frames(deployment: Cluster) -> None:
    """A `video_url` mp4 through the HTTP API answers as the gRPC client sending the file."""
    assert deployment.http_url is not None
    clip = make_video()
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    question = "What happens in the clip?"
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": question},
            ],
        }
    ]
    stream = await api(deployment.http_url).chat.completions.create(
        model=MODEL_ID, messages=messages, stream=True, **GREEDY
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    video: dict[str, Any] = {"type": "video", "video": clip}
    chat = [{"role": "user", "content": [video, {"type": "text", "text": question}]}]
    async with Client(deployment.address, api_key=deployment.client_key) as grpc_client:
        expected = await grpc_client.generate_text(
            chat, SamplingParams(max_tokens=6, ignore_eos=True)
        )
    assert expected.prompt_tokens > 0 and "".join(pieces) == expected.text
