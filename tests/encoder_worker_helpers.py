"""Shared by the encoder worker tests: the module's `tower` and the `make_server` fixtures,
and the builders of prompts, encode items and requests (`_image`, `_video`, `_item`,
`_request`), the reader of returned rows, and the engine's forward counter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.models.qwen3_vl.vision import VisionTower
from common.processing.processor import ProcessedPrompt, Processor
from common.server.role import RoleServer
from common.server.rpc import channel
from common.wire.convert import tensor_from_ref, tensor_to_ref
from encoder_worker.server import EncoderServicer, load_tower, serve
from encoder_worker.settings import EncoderSettings
from epd.v1 import encoder_service_pb2, encoder_service_pb2_grpc, multimodal_pb2
from tests.cluster import cluster_credentials, cluster_security

# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tower(ckpt: Path) -> VisionTower:
    return load_tower(ckpt, EncoderSettings())[1]


def _user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def _image(processor: Processor, seed: int, h: int = 64, w: int = 64) -> ProcessedPrompt:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return processor.process(_user({"type": "image", "image": data}))


def _video(processor: Processor, seed: int, frames: int = 6) -> ProcessedPrompt:
    rng = np.random.default_rng(seed)
    data = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(frames)]
    return processor.process(_user({"type": "video", "video": data, "fps": 2.0}))


def _item(
    prompt: ProcessedPrompt, partitions: tuple[int, ...] = (), subset_pixels: bool = False
) -> encoder_service_pb2.EncodeItem:
    meta = prompt.params.items[0]
    pixels = prompt.pixel_values[0]
    if subset_pixels:
        pixels = torch.cat(
            [
                pixels[meta.partitions[p].input_start : meta.partitions[p].input_end]
                for p in partitions
            ]
        )
    modality = {
        "image": multimodal_pb2.MODALITY_IMAGE,
        "video": multimodal_pb2.MODALITY_VIDEO,
    }[str(meta.modality)]
    return encoder_service_pb2.EncodeItem(
        content_hash=meta.content_hash,
        modality=modality,
        pixel_values=tensor_to_ref(pixels),
        grid_thw=list(prompt.grid_thw[0]),
        partitions=[
            multimodal_pb2.ItemPartition(
                input_start=p.input_start,
                input_end=p.input_end,
                output_rows=p.output_rows,
                content_hash=p.content_hash,
            )
            for p in meta.partitions
        ],
        partition_indices=list(partitions),
    )


def _request(
    *items: encoder_service_pb2.EncodeItem, request_id: str = "t"
) -> encoder_service_pb2.EncodeRequest:
    return encoder_service_pb2.EncodeRequest(request_id=request_id, items=list(items))


def _rows(item: encoder_service_pb2.EncodedItem) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return tensor_from_ref(item.rows), [tensor_from_ref(d) for d in item.deepstack]


Factory = Callable[..., Awaitable[tuple[RoleServer[EncoderServicer], Any]]]


@pytest.fixture
async def make_server(ckpt: Path) -> AsyncIterator[Factory]:
    """Start encoder workers (NIXL off unless asked); stops them and their channels."""
    started: list[tuple[RoleServer[EncoderServicer], Any]] = []

    async def make(**overrides: Any) -> tuple[RoleServer[EncoderServicer], Any]:
        fields: dict[str, Any] = {
            "model": str(ckpt),
            "nixl": False,
            "security": cluster_security(),
            **overrides,
        }
        server = await serve(EncoderSettings(**fields))
        ch = channel(server.address, credentials=cluster_credentials())
        started.append((server, ch))
        return server, encoder_service_pb2_grpc.EncoderServiceStub(ch)

    yield make
    for server, ch in started:
        await ch.close()
        await server.stop(0)


def _engine(server: RoleServer[EncoderServicer]) -> Any:
    assert server.servicer is not None
    return server.servicer.engine


def _count_forwards(server: RoleServer[EncoderServicer]) -> list[int]:
    """Wrap the tower's encode to count calls (independent of the engine's counter)."""
    engine = _engine(server)
    calls = [0]
    original = engine.tower.encode

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    engine.tower.encode = counted
    return calls
