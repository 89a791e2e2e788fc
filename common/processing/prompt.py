"""`ProcessedPrompt`: what `Processor.process` makes of a request, and its encoder inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.multimodal.params import MultimodalParams
from common.processing.image import as_patch_values


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
    # Per item in prompt order: (t*h*w, patch_dim) uint8 patch codes (`common.processing.image`)
    pixel_values: tuple[torch.Tensor, ...]
    grid_thw: tuple[tuple[int, int, int], ...]  # per item in prompt order (see above)
    prompt_text: str = ""  # the rendered prompt, for logs and tests
    frame_timestamps: tuple[tuple[float, ...], ...] = field(default=())  # per item (video)
    settings: ProcessorSettings | None = None  # the processor's: codes -> values (None: floats)

    def vision_inputs(
        self, items: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated patch rows (float32 values, `as_patch_values`) and `(n, 3)` grids of
        the given items (default: all), ready for `VisionTower.encode`."""
        chosen = range(len(self.grid_thw)) if items is None else items
        pixels = [self.pixel_values[i] for i in chosen]
        grids = [self.grid_thw[i] for i in chosen]
        if not pixels:
            raise ValueError("no items to encode")
        return self._values(torch.cat(pixels)), torch.tensor(grids, dtype=torch.int64)

    def _values(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.settings is None:
            if pixels.dtype == torch.uint8:
                raise ValueError("patch codes without the processor settings that map them")
            return pixels
        return as_patch_values(pixels, self.settings)
