"""Processed video partitions, cached: a video sent again with frames appended is not
decoded, resized, patchified and hashed again for the frames it shares.

Exactness. A temporal patch's rows are a function of its source frames' pixels and the size
they are resized to, and nothing else: frames are resized one by one (`resize_rgb`), and
`patch_codes` places their bytes by a reordering alone (patch `k`'s rows are those of frames
`2k, 2k + 1`). But *which* frames a patch holds and *that size* depend on the whole video
(`plan_video`): the sampling spreads over the frame count, and the smart-resize pixel budget
covers every frame, so once it binds, appending frames shrinks all of them. So an entry is
keyed by the resized size plus the keys of the patch's source frames in order (`patch_key`),
each frame's key being the processed-image key of its encoded bytes (`image_key`: SHA-256
over the processor settings' fingerprint, the tenant's cache salt and the bytes): same key,
same codes bit for bit, and the same partition content hash (stored with them). Where the
plan changes, keys change and the patches are made afresh. The item's own content hash still
covers all its rows (the processor computes it as always).

The entries live in the processor's processed-image cache (`ProcessedImage`: codes, grid
`(1, h, w)`, content hash; one LRU and byte budget for both), under keys of their own
domain tag. The router keys a video's frames when it reads the request
(`router.inputs`) and decodes only the frames of patches the cache does not hold
(`frames_to_decode`); `preprocess_keyed` then takes the others from the cache, and an
entry gone meanwhile is decoded from the bytes the frame keeps.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence

import numpy as np
from PIL import Image

from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.processing.content_hash import content_hash
from common.processing.image import KeyedImage, load_image, patch_codes
from common.processing.image_cache import ImageStore, ProcessedImage
from common.processing.limits import check_fps
from common.processing.video import (
    ProcessedVideo,
    VideoPlan,
    plan_video,
    resized_frames,
    video_timestamps,
)

# Domain tag of temporal patch keys; bump it if the keyed layout changes.
_PATCH_TAG = b"epd.processed-video-patch.v1"


def patch_key(frame_keys: Sequence[bytes], size: tuple[int, int]) -> bytes:
    """Cache key of one temporal patch: its source frames' keys, in order, resized to
    `size` `(height, width)`."""
    h = hashlib.blake2b(_PATCH_TAG, digest_size=32)
    h.update(size[0].to_bytes(4, "little") + size[1].to_bytes(4, "little"))
    for key in frame_keys:
        h.update(key)
    return h.digest()


def patch_keys(
    plan: VideoPlan, frame_keys: Sequence[bytes], settings: ProcessorSettings
) -> list[bytes]:
    """The key of each temporal patch of a planned video whose frames have `frame_keys`."""
    return [
        patch_key([frame_keys[i] for i in group], plan.size)
        for group in plan.groups(settings.temporal_patch_size)
    ]


def frames_to_decode(
    frame_keys: Sequence[bytes],
    fps: float,
    width: int,
    height: int,
    settings: ProcessorSettings,
    cache: ImageStore,
) -> set[int]:
    """Indexes of the frames a video's processing needs decoded: those of its temporal
    patches the cache does not hold (frames it does not sample are never needed)."""
    plan = plan_video(len(frame_keys), fps, width, height, settings)
    groups = plan.groups(settings.temporal_patch_size)
    keys = patch_keys(plan, frame_keys, settings)
    return {i for group, key in zip(groups, keys, strict=True) if key not in cache for i in group}


def is_keyed(frames: object) -> bool:
    """Whether a video's frames are all keyed by their encoded bytes (`KeyedImage`)."""
    return (
        isinstance(frames, Sequence)
        and len(frames) > 0
        and all(isinstance(f, KeyedImage) for f in frames)
    )


def preprocess_keyed(
    frames: Sequence[KeyedImage],
    fps: float,
    settings: ProcessorSettings,
    cache: ImageStore,
    fingerprint: bytes,
) -> ProcessedVideo:
    """`preprocess_video` of frames keyed by their encoded bytes: each temporal patch from
    the cache, or made from its frames (decoded here if they were not) and stored with its
    content hash (`content_hash` under `fingerprint`, as the processor hashes partitions).
    The frames must share one size (the router checks it from their headers)."""
    check_fps(fps)
    first = frames[0]
    # Its size from its header: a video whose patches are all cached decodes no frame.
    width, height = first.image.size if first.image else Image.open(io.BytesIO(first.data)).size
    plan = plan_video(len(frames), fps, width, height, settings)
    keys = patch_keys(plan, [f.key for f in frames], settings)
    parts: list[ProcessedImage] = []
    made: list[int] = []  # the parts made here, stored once the video's rows are joined
    for group, key in zip(plan.groups(settings.temporal_patch_size), keys, strict=True):
        part = cache.get(key)
        if part is None:
            images = [load_image(frames[i]) for i in group]
            if any(im.size != (width, height) for im in images):
                raise ValueError("video frames differ in size")
            rows, grid = patch_codes(resized_frames(images, plan.size), settings)
            part = ProcessedImage(rows, grid, content_hash(fingerprint, "video", rows, grid))
            made.append(len(parts))
        parts.append(part)
    _, grid_h, grid_w = parts[0].grid
    joined = np.concatenate([p.patches for p in parts])
    # Stored as views of the joined rows, which the prompt holds, where most of them are
    # new: not a second copy of them (a staged request held both until its first token).
    # Where most came from the cache, copies of the new ones: a view would keep, and the
    # cache count, the whole video again for one new patch, and evict its others to fit
    # it (ownfix reviews).
    ends = np.cumsum([len(p.patches) for p in parts])
    shared = 2 * sum(len(parts[k].patches) for k in made) >= len(joined)
    for k in made:
        part = parts[k]
        if shared:
            rows = joined[ends[k] - len(part.patches) : ends[k]]
            part = ProcessedImage(rows, part.grid, part.content_hash, joined)
        cache.put(keys[k], part)
    return ProcessedVideo(
        joined,
        (len(parts), grid_h, grid_w),
        video_timestamps(plan, fps, settings, None),
        tuple(p.content_hash for p in parts),
    )
