"""What a request's media will cost once processed, counted from their headers before any is
decoded (DESIGN §7: limits come before work).

A header's own size says little: the processor resizes every image up to its `min_pixels`
(a 1x1 PNG of 69 bytes becomes 393 KB of patch codes with the released model's settings)
and every video to its sampled frames at their resized size. `MediaCost` runs the same
resize and sampling rules on the header sizes (`smart_resize`, `plan_video`: cheap functions
of a few integers) and, per request,

- adds the patch codes each item will make to the request's `MediaBudget` (so
  `max_media_bytes` and the router's in-flight reservation bound the memory processing will
  take, not only the decoded pixels), and
- counts the prompt tokens the items will take, refusing the request once they reach the
  model's context (`max_model_len`): a request of 100,000 tiny images is refused from its
  headers, not after minutes of processing and tens of gigabytes.

Counts are exact for images and for videos given as frames; for a video file the sample
times of its header stand for its frames. Text and control tokens are not counted here
(the processor's tokenizer counts those, after); media alone reaching the context is enough
to refuse.
"""

from __future__ import annotations

from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.processing.image import smart_resize
from common.processing.limits import DECODED_BYTES_PER_PIXEL, InputLimits, LimitError, MediaBudget
from common.processing.video import plan_video
from common.processing.video_file import VideoHeader
from common.processing.video_memory import FRAME_BYTES_PER_PIXEL, decoder_bytes

# What resizing one image or frame takes for a while, a resized pixel: the resized image
# (4) and its pixels as an array (3).
RESIZED_BYTES_PER_PIXEL = 7


class MediaCost:
    """The processed size of one request's media, counted as their headers are read."""

    def __init__(
        self, settings: ProcessorSettings | None, limits: InputLimits, budget: MediaBudget
    ) -> None:
        self.settings = settings  # the processor's resize rules (None: nothing counted)
        self.limits = limits
        self.budget = budget  # the request's media bytes, decoded and processed
        self.tokens = 0  # prompt tokens of the media so far

    def image(self, width: int, height: int, field: str) -> None:
        """Count one image of `width` x `height` (its header's); `LimitError` naming
        `field` past `max_media_bytes` or the context."""
        s = self.settings
        if s is None:
            return
        h, w = smart_resize(
            height, width, factor=s.factor, min_pixels=s.min_pixels, max_pixels=s.max_pixels
        )
        self._add(h, w, 1, field)
        # Its codes, counted as kept, are made after it is resized: resizing it takes what
        # they will beyond that, beside what making it RGB left (its own transient,
        # `MediaBudget.add`); making them, the resized pixels beside them (ownfix review:
        # the two were counted together, 30% more than a photo's measured peak).
        codes = len(s.image_mean) * s.temporal_patch_size  # bytes a resized pixel
        self.budget.briefly(max(0, RESIZED_BYTES_PER_PIXEL - codes) * h * w, field)
        self.budget.briefly(len(s.image_mean) * h * w, field, alone=True)

    def video(
        self, frames: int, fps: float, width: int, height: int, field: str, alone: bool = False
    ) -> None:
        """Count one video of `frames` frames (given, or its header's sample times) of
        `width` x `height` at `fps`, processed beside the most one frame took for a while
        (frames given as images) or `alone` (a file's); `LimitError` naming `field` as for
        `image`, or for a frame shape the processor would refuse."""
        s = self.settings
        if s is None:
            return
        try:
            plan = plan_video(frames, fps, width, height, s)  # the processor's own plan
        except ValueError as exc:  # a frame shape the video resize refuses
            raise LimitError(field, str(exc)) from None
        self._add(*plan.size, len(plan.padded) // s.temporal_patch_size, field)
        # Its resized frames, stacked (3 bytes a pixel), and one frame at a time made an
        # image (of a decoded file's array), RGB and resized.
        h, w = plan.size
        one = DECODED_BYTES_PER_PIXEL * width * height + RESIZED_BYTES_PER_PIXEL * h * w
        self.budget.briefly(len(plan.indices) * h * w * 3 + one, field, alone)

    def video_file(self, header: VideoHeader, fps: float, field: str) -> None:
        """Count a video file from its header, sampled at `fps`: a decoded frame (RGB) a
        sample time, what FFmpeg holds while it decodes (gone before it is processed), and
        the frames as `video` counts them, at the rate they were sampled at."""
        width, height, count = header.width, header.height, len(header.sample_times)
        self.budget.add_bytes(count * width * height * FRAME_BYTES_PER_PIXEL, field)
        self.budget.briefly(decoder_bytes(header), field, alone=True)
        self.video(count, fps, width, height, field, alone=True)

    def _add(self, height: int, width: int, steps: int, field: str) -> None:
        """`steps` temporal patches of `height` x `width` resized pixels."""
        s = self.settings
        assert s is not None
        patch_bytes = height * width * len(s.image_mean) * s.temporal_patch_size
        self.budget.add_bytes(steps * patch_bytes, field)
        self.tokens += steps * (height // s.factor) * (width // s.factor)
        context = self.limits.max_model_len
        if context is not None and self.tokens >= context:
            raise LimitError(
                field,
                f"the request's media alone take {self.tokens} prompt tokens once processed; "
                f"the model's context is {context} tokens, and the prompt's text and at least "
                "one generated token must fit too",
            )
