"""Qwen3-VL input processing: typed chat messages -> token ids, item layout and patch rows.

`Processor.process` renders the chat template (the checkpoint's own when it has one, see
`common.processing.template`; else the built-in layout of `common.processing.chat`),
preprocesses every image and video, expands each into placeholder tokens, tokenises the
result and derives each item's exact runs from the placeholder mask
(`common.multimodal.runs_from_mask`). The output carries no embeddings: the encoder makes
them later from `pixel_values`.

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

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

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
from common.processing.content_hash import content_hash, processor_settings
from common.processing.image import FloatArray, preprocess_image
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
from common.processing.template import ChatTemplate, load_chat_template
from common.processing.video import preprocess_video

logger = logging.getLogger(__name__)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A processed request: what the router hashes and every stage reads.

    `grid_thw[i]` is item i's vision patch grid `(t, h, w)`, exactly what the vision tower
    takes: t temporal patches (1 for an image; for a video, sampled frames /
    temporal_patch_size) and h x w patches of `patch_size` pixels per temporal patch. The item
    makes `t * h * w / merge_size**2` embedding rows. For mRoPE (reference `get_rope_index`)
    each temporal patch is placed like a one-frame image: a video item has t runs, run k
    holding `(h / merge_size) * (w / merge_size)` tokens whose positions are
    `(start, start + row, start + col)` with `start` the text position where the run begins;
    the text after a run resumes at `start + max(h, w) / merge_size`. The same grid is in
    `params.items[i].grid_thw`, so later stages need nothing else.
    """

    prompt_token_ids: list[int]  # the whole prompt, placeholders included
    params: MultimodalParams  # items in prompt order, with exact runs; no embeddings
    pixel_values: tuple[torch.Tensor, ...]  # per item in prompt order: (t*h*w, patch_dim) f32
    grid_thw: tuple[tuple[int, int, int], ...]  # per item in prompt order (see above)
    prompt_text: str = ""  # the rendered prompt, for logs and tests
    frame_timestamps: tuple[tuple[float, ...], ...] = field(default=())  # per item (video)

    def vision_inputs(
        self, items: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated patch rows and `(n, 3)` grids of the given items (default: all), ready
        for `VisionTower.encode`."""
        chosen = range(len(self.grid_thw)) if items is None else items
        pixels = [self.pixel_values[i] for i in chosen]
        grids = [self.grid_thw[i] for i in chosen]
        if not pixels:
            raise ValueError("no items to encode")
        return torch.cat(pixels), torch.tensor(grids, dtype=torch.int64)

    def partition_inputs(
        self, item: int, partitions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Patch rows and grids of some partitions of one item (each its own grid row)."""
        meta = self.params.items[item]
        _, h, w = self.grid_thw[item]
        parts = meta.partitions
        if not parts:
            if list(partitions) != [0]:
                raise ValueError(f"item {item} has a single partition")
            return self.vision_inputs([item])
        rows = [
            self.pixel_values[item][parts[p].input_start : parts[p].input_end] for p in partitions
        ]
        grids = [(parts[p].input_end - parts[p].input_start) // (h * w) for p in partitions]
        return torch.cat(rows), torch.tensor([(g, h, w) for g in grids], dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class _Media:
    """One preprocessed item before placement."""

    modality: Modality
    payload_index: int
    uuid: str | None
    patches: FloatArray
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]


class Processor:
    """Tokeniser + image/video preprocessing of one Qwen3-VL checkpoint."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: Qwen3VLConfig,
        settings: ProcessorSettings,
        template: ChatTemplate | None = None,
        generation: GenerationDefaults | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.settings = settings
        # The checkpoint's own chat template; None renders the built-in ChatML layout.
        self.template = template
        # The checkpoint's default sampling (`generation_config.json`), for the front doors.
        self.generation = generation or GenerationDefaults()
        vision = config.vision
        if (settings.patch_size, settings.merge_size, settings.temporal_patch_size) != (
            vision.patch_size,
            vision.spatial_merge_size,
            vision.temporal_patch_size,
        ):
            raise ValueError(
                "preprocessor patch/merge/temporal sizes differ from the vision config"
            )
        for token, expected in (
            (IMAGE_PAD, config.image_token_id),
            (VIDEO_PAD, config.video_token_id),
            (VISION_START, config.vision_start_token_id),
            (VISION_END, config.vision_end_token_id),
        ):
            actual = tokenizer.token_to_id(token)
            if actual != expected:
                raise ValueError(f"tokenizer id of {token} is {actual}, config says {expected}")
        self._fingerprint = settings.fingerprint()
        # The same tokenizer, reading special tokens in text as plain text (user text); a
        # copy rather than a toggled flag, so concurrent `process` calls stay independent.
        self._text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._text_tokenizer.encode_special_tokens = True

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Processor:
        """Read tokenizer.json, config.json, the processor settings files
        (`common.models.qwen3_vl.processor_files`), the chat template if the checkpoint has
        one (`common.processing.template`) and `generation_config.json`."""
        folder = Path(folder)
        config = Qwen3VLConfig.from_file(folder)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        settings = processor_settings(folder, config)
        template = load_chat_template(folder, tokenizer)
        return cls(tokenizer, config, settings, template, GenerationDefaults.from_folder(folder))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end generation (from config/generation settings)."""
        if self.config.eos_token_ids:
            return self.config.eos_token_ids
        return tuple(t for t in (self.tokenizer.token_to_id("<|im_end|>"),) if t is not None)

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
        media: list[_Media] = []
        segments: list[str | Control] = []
        for piece in pieces:
            if isinstance(piece, str | Control):
                segments.append(piece)
                continue
            index = payload_index[len(media)]
            data = piece.payload if piece.payload is not None else sides[piece.modality][index]
            item = self._preprocess(piece, data, index)
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
            if stretch:
                ids.extend(text_tokenizer.encode("".join(stretch), add_special_tokens=False).ids)
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

    def _preprocess(self, slot: MediaPart, data: Any, payload_index: int) -> _Media:
        if isinstance(slot, ImagePart):
            patches, grid = preprocess_image(data, self.settings)
            return _Media(slot.modality, payload_index, slot.uuid, patches, grid, ())
        fps = slot.fps
        if fps is None:
            fps = self.settings.video_default_fps
            logger.warning("video %d has no fps; assuming %.1f", payload_index, fps)
        video = preprocess_video(data, fps, self.settings)
        return _Media(
            slot.modality, payload_index, slot.uuid, video.patches, video.grid_thw, video.timestamps
        )

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
            items.append(
                MultimodalItemMetadata(
                    content_hash=self._hash(m.modality, m.patches, m.grid),
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
        )

    def _partitions(self, item: _Media) -> tuple[ItemPartition, ...]:
        """Video: one partition per temporal patch (the tower attends within a frame only).
        Images: none, the item is its own single part."""
        if item.modality != Modality.VIDEO:
            return ()
        t, h, w = item.grid
        step = h * w
        return tuple(
            ItemPartition(
                input_start=k * step,
                input_end=(k + 1) * step,
                output_rows=step // self.settings.merge_size**2,
                content_hash=self._hash(
                    item.modality, item.patches[k * step : (k + 1) * step], (1, h, w)
                ),
            )
            for k in range(t)
        )

    def _hash(self, modality: Modality, patches: FloatArray, grid: tuple[int, int, int]) -> bytes:
        """The item's (or partition's) content hash (`common.processing.content_hash`)."""
        return content_hash(self._fingerprint, str(modality), patches, grid)
