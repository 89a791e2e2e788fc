"""Qwen3-VL input processing: typed chat messages -> token ids, item layout and patch codes.

`Processor.process` renders the chat template (the checkpoint's own when it has one, see
`common.processing.template`; else the built-in layout of `common.processing.chat`),
preprocesses every image and video, expands each into placeholder tokens, tokenises the
result and derives each item's exact runs from the placeholder mask
(`common.multimodal.runs_from_mask`). The output carries no embeddings: the encoder makes
them later from `pixel_values`, uint8 patch codes (`common.processing.image`).

Placeholder layout per item (m = merge_size, grid `(t, h, w)` in patches):
- image: `<|vision_start|>` + (h/m)*(w/m) x `<|image_pad|>` + `<|vision_end|>` -> one run;
- video: per temporal patch k: `<{ts_k:.1f} seconds>` + `<|vision_start|>` +
  (h/m)*(w/m) x `<|video_pad|>` + `<|vision_end|>` -> t runs, separated by text.

User text is text: only the chat template and the placeholders above insert control tokens.
Each stretch of text between them is tokenized with special tokens read as plain text (a
typed `<|im_start|>` becomes the tokens of its characters), unless the caller passes
`allow_special_tokens=True`. Tokenizing the stretches apart gives the same ids as
tokenizing the whole prompt at once would for text without special tokens, because the
tokenizer splits at special tokens before anything else.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from common.errors import CheckpointError
from common.models.checkpoint_files import read_tokenizer
from common.models.generation import GenerationDefaults
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.preprocessor import ProcessorSettings, partition_keys_exact
from common.multimodal.params import (
    ItemPartition,
    Modality,
    MultimodalItemMetadata,
    MultimodalParams,
    runs_from_mask,
)
from common.processing.chat import Control, render_chat
from common.processing.content_hash import (
    content_hash,
    item_content_hash,
    processor_settings,
    video_partitions,
)
from common.processing.image import ByteArray, KeyedImage, preprocess_image
from common.processing.image_cache import ImageStore, ProcessedImage, ProcessedImageCache, image_key
from common.processing.limits import InputLimits, check_text_bytes
from common.processing.messages import (
    ChatDicts,
    ImagePart,
    MediaPart,
    Message,
    assign_payloads,
    check_text_limits,
    messages_from_dicts,
)
from common.processing.prompt import ProcessedPrompt
from common.processing.template import ChatTemplate, load_chat_template
from common.processing.token_bytes import byte_level_table
from common.processing.video import preprocess_video
from common.processing.video_cache import is_keyed, preprocess_keyed

logger = logging.getLogger(__name__)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True, slots=True)
class _Media:
    """One preprocessed item before placement."""

    modality: Modality
    payload_index: int
    uuid: str | None
    patches: ByteArray  # uint8 patch codes
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]
    content_hash: bytes | None = None  # known already (a processed image); None: hash later
    partition_hashes: tuple[bytes, ...] = ()  # known already (cached video patches); (): later


class Processor:
    """Tokeniser + image/video preprocessing of one Qwen3-VL checkpoint."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: Qwen3VLConfig,
        settings: ProcessorSettings,
        template: ChatTemplate | None = None,
        generation: GenerationDefaults | None = None,
        image_cache: ProcessedImageCache | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.settings = settings
        # The checkpoint's own chat template; None renders the built-in ChatML layout.
        self.template = template
        # The checkpoint's default sampling (`generation_config.json`), for the front doors.
        self.generation = generation or GenerationDefaults()
        # Encoded image bytes -> processed image (`common.processing.image_cache`); None:
        # every image is preprocessed every time.
        self.image_cache = image_cache
        vision = config.vision
        sizes = (settings.patch_size, settings.merge_size, settings.temporal_patch_size)
        ours = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
        if sizes != ours:
            raise CheckpointError(
                f"preprocessor patch/merge/temporal sizes {sizes} differ from the vision "
                f"config's {ours} (preprocessor_config.json, config.json)"
            )
        for token, expected in (
            (IMAGE_PAD, config.image_token_id),
            (VIDEO_PAD, config.video_token_id),
            (VISION_START, config.vision_start_token_id),
            (VISION_END, config.vision_end_token_id),
        ):
            actual = tokenizer.token_to_id(token)
            if actual != expected:
                raise CheckpointError(
                    f"tokenizer.json: id of {token} is {actual}, config.json says {expected}"
                )
        self._fingerprint = settings.fingerprint()
        # The same tokenizer, reading special tokens in text as plain text (user text); a
        # copy rather than a toggled flag, so concurrent `process` calls stay independent.
        self._text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._text_tokenizer.encode_special_tokens = True

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, image_cache_bytes: int = 0) -> Processor:
        """Read tokenizer.json, config.json, the processor settings files
        (`common.models.qwen3_vl.processor_files`), the chat template if the checkpoint has
        one (`common.processing.template`) and `generation_config.json`. With
        `image_cache_bytes` > 0, processed images of encoded bytes are cached up to that many
        bytes of patch rows (`image_cache`)."""
        folder = Path(folder)
        config = Qwen3VLConfig.from_file(folder)
        tokenizer = read_tokenizer(folder / "tokenizer.json")
        settings = processor_settings(folder, config)
        template = load_chat_template(folder, tokenizer)
        cache = ProcessedImageCache(image_cache_bytes) if image_cache_bytes > 0 else None
        return cls(
            tokenizer,
            config,
            settings,
            template,
            GenerationDefaults.from_folder(folder),
            image_cache=cache,
        )

    def image_key(self, data: bytes, salt: str | None = None) -> bytes:
        """The processed-image cache key of encoded image bytes under these settings, for
        the cache salt `salt` (a tenant's; None: none)."""
        return image_key(self._fingerprint, data, salt)

    @functools.cached_property
    def token_bytes(self) -> list[bytes] | None:
        """Each token's bytes (`common.processing.token_bytes`), what incremental decoding
        reads; None for a tokenizer that is not byte-level."""
        return byte_level_table(self.tokenizer)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids -> text."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def process(
        self,
        messages: Sequence[Message] | ChatDicts,
        *,
        images: Sequence[Any] = (),
        videos: Sequence[Any] = (),
        add_generation_prompt: bool = True,
        allow_special_tokens: bool = False,
        limits: InputLimits | None = None,
        store: ImageStore | None = None,
    ) -> ProcessedPrompt:
        """Render, preprocess and tokenise a chat request.

        `messages` are typed (`common.processing.messages`); the dict form is still taken
        and converted first by `messages_from_dicts`, the same converter the Engine uses.
        Media parts carry their data inline or refer to `images` / `videos` (the payloads, in
        payload order) by `index`; a part with neither takes the next unreferenced payload.
        Inline payloads are numbered after the side payloads, in prompt order. Special tokens
        in text (roles, text parts) are tokenized as plain text unless
        `allow_special_tokens`. Raises `ValueError` on malformed messages, unknown payload
        indexes or (with `allow_special_tokens`) text that spells out placeholder tokens;
        `LimitError` (a `ValueError` naming the field) when the text is over
        `limits.max_text_bytes`, checked before anything is tokenized or preprocessed.
        Processed images are looked up in and stored to `store` (None: `image_cache`; the
        router's `StagedImages` keeps them only for a request it answers).
        """
        chat = messages_from_dicts(messages)
        if limits is not None:
            check_text_limits(chat, limits)
        if self.template is not None:
            pieces = self.template.render(chat, add_generation_prompt=add_generation_prompt)
        else:
            pieces = render_chat(chat, add_generation_prompt=add_generation_prompt)
        slots = [p for p in pieces if not isinstance(p, str | Control)]
        payload_index = assign_payloads(
            slots, {Modality.IMAGE: len(images), Modality.VIDEO: len(videos)}
        )
        sides = {Modality.IMAGE: images, Modality.VIDEO: videos}
        cache = self.image_cache if store is None else store
        media: list[_Media] = []
        segments: list[str | Control] = []
        for piece in pieces:
            if isinstance(piece, str | Control):
                segments.append(piece)
                continue
            index = payload_index[len(media)]
            data = piece.payload if piece.payload is not None else sides[piece.modality][index]
            item = self._preprocess(piece, data, index, cache)
            media.append(item)
            segments.extend(self._placeholders(item))
        text = "".join(s if isinstance(s, str) else s.token * s.count for s in segments)
        ids = self._tokenize(segments, allow_special_tokens)
        return self._layout(ids, text, media)

    def process_text(
        self,
        text: str,
        *,
        allow_special_tokens: bool = False,
        limits: InputLimits | None = None,
    ) -> ProcessedPrompt:
        """A plain-text prompt tokenized as it is: no chat template, no media (text
        completions). Special tokens in it are text unless `allow_special_tokens`;
        `LimitError` naming "prompt" past `limits.max_text_bytes`, before tokenizing."""
        if limits is not None:
            check_text_bytes(len(text.encode()), limits, "prompt")
        return self._layout(self._tokenize([text], allow_special_tokens), text, [])

    def _tokenize(self, segments: Sequence[str | Control], allow_special: bool) -> list[int]:
        """Ids of the segments: control tokens as themselves, each stretch of text between
        them tokenized whole (see the module docstring)."""
        text_tokenizer = self.tokenizer if allow_special else self._text_tokenizer
        ids: list[int] = []
        stretch: list[str] = []

        def flush() -> None:
            # `encode_batch`, not `encode`: the same ids, but it lets go of the GIL while it
            # works (`encode` held it: a tenant's 1 MiB prompt stalled the router's event loop
            # for everyone for a second, prepare threads or not; httpattack review).
            if stretch:
                (encoded,) = text_tokenizer.encode_batch(
                    ["".join(stretch)], add_special_tokens=False
                )
                ids.extend(encoded.ids)
                stretch.clear()

        for segment in segments:
            if isinstance(segment, str):
                stretch.append(segment)
                continue
            flush()
            token_id = self.tokenizer.token_to_id(segment.token)
            if token_id is None:
                raise ValueError(f"tokenizer has no control token {segment.token}")
            ids.extend([token_id] * segment.count)
        flush()
        return ids

    def _preprocess(
        self, slot: MediaPart, data: Any, payload_index: int, cache: ImageStore | None
    ) -> _Media:
        if isinstance(slot, ImagePart):
            image = self._image(data, cache)
            return _Media(
                slot.modality,
                payload_index,
                slot.uuid,
                image.patches,
                image.grid,
                (),
                image.content_hash,
            )
        fps = slot.fps
        if fps is None:
            fps = self.settings.video_default_fps
            logger.warning("video %d has no fps; assuming %.1f", payload_index, fps)
        if cache is not None and is_keyed(data):  # frames keyed by the router's reader
            video = preprocess_keyed(data, fps, self.settings, cache, self._fingerprint)
        else:
            video = preprocess_video(data, fps, self.settings)
        return _Media(
            slot.modality,
            payload_index,
            slot.uuid,
            video.patches,
            video.grid_thw,
            video.timestamps,
            partition_hashes=video.partition_hashes,
        )

    def _image(self, data: Any, cache: ImageStore | None) -> ProcessedImage:
        """One image preprocessed and hashed; from `cache` when it holds the encoded bytes'
        key (a `KeyedImage`'s, or that of plain bytes), and stored there otherwise."""
        key = None
        if cache is not None:
            if isinstance(data, KeyedImage):
                key = data.key
            elif isinstance(data, bytes | bytearray | memoryview):
                key = self.image_key(bytes(data))
            if key is not None and (hit := cache.get(key)) is not None:
                return hit
        patches, grid = preprocess_image(data, self.settings)
        digest = content_hash(self._fingerprint, str(Modality.IMAGE), patches, grid)
        image = ProcessedImage(patches, grid, digest)
        if cache is not None and key is not None:
            cache.put(key, image)
        return image

    def _placeholders(self, item: _Media) -> list[str | Control]:
        """The item's placeholder layout (see the module docstring)."""
        t, h, w = item.grid
        per_step = (h // self.settings.merge_size) * (w // self.settings.merge_size)
        if item.modality == Modality.IMAGE:
            return [Control(VISION_START), Control(IMAGE_PAD, t * per_step), Control(VISION_END)]
        out: list[str | Control] = []
        for ts in item.timestamps:
            out += [f"<{ts:.1f} seconds>", Control(VISION_START), Control(VIDEO_PAD, per_step)]
            out.append(Control(VISION_END))
        return out

    def _layout(self, ids: list[int], text: str, media: list[_Media]) -> ProcessedPrompt:
        token_ids = np.asarray(ids, dtype=np.int64)
        merge_unit = self.settings.merge_size**2
        lengths = [int(np.prod(m.grid)) // merge_unit for m in media]
        for modality, token_id in (
            (Modality.IMAGE, self.config.image_token_id),
            (Modality.VIDEO, self.config.video_token_id),
        ):
            found = int((token_ids == token_id).sum())
            expected = sum(n for n, m in zip(lengths, media, strict=True) if m.modality == modality)
            if found != expected:
                raise ValueError(
                    f"prompt holds {found} {modality} placeholder tokens, its media need "
                    f"{expected}: the text must not contain placeholder tokens itself"
                )
        mask = (token_ids == self.config.image_token_id) | (token_ids == self.config.video_token_id)
        cu, positions, run_lengths = (
            runs_from_mask(mask, lengths)
            if media
            else (np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        )
        items = []
        for i, m in enumerate(media):
            runs = tuple(
                (int(positions[r]), int(run_lengths[r])) for r in range(int(cu[i]), int(cu[i + 1]))
            )
            parts = self._partitions(m)
            rows = [p.output_rows for p in parts]
            kind = str(m.modality)
            items.append(
                MultimodalItemMetadata(
                    content_hash=m.content_hash
                    or item_content_hash(self._fingerprint, kind, m.patches, m.grid, parts),
                    runs=runs,
                    modality=m.modality,
                    payload_index=m.payload_index,
                    uuid=m.uuid,
                    partitions=parts,
                    encoder_cost=float(m.patches.shape[0]),
                    grid_thw=m.grid,
                    frame_timestamps=m.timestamps,
                    partition_keys=bool(parts) and partition_keys_exact(self.settings, runs, rows),
                )
            )
        return ProcessedPrompt(
            prompt_token_ids=[int(i) for i in ids],
            params=MultimodalParams.from_items(items),
            pixel_values=tuple(torch.from_numpy(m.patches) for m in media),
            grid_thw=tuple(m.grid for m in media),
            prompt_text=text,
            frame_timestamps=tuple(m.timestamps for m in media),
            settings=self.settings,
        )

    def _partitions(self, item: _Media) -> tuple[ItemPartition, ...]:
        """Video: one per temporal patch (`video_partitions`). Images: none, the item is its
        own single part."""
        if item.modality != Modality.VIDEO:
            return ()
        merge = self.settings.merge_size
        known = item.partition_hashes
        return video_partitions(self._fingerprint, item.patches, item.grid, merge, known)
