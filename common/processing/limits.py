"""Input limits, checked before the work they bound (DESIGN §7: limits come before work).

`InputLimits` is what a caller (the router, from its settings) asks `Processor.process` and
the media readers to enforce; None disables a limit. Each check raises `LimitError`, a
`FieldError` naming the offending request field and the limit, before anything is decoded,
tokenized or allocated for it:
- text bytes are counted before tokenizing (`check_text_bytes`);
- an image's or frame's size comes from its header (PIL reads it lazily in `Image.open`),
  checked before `load()` (`check_image_header`), and the decoded bytes of every item of a
  request are summed against one budget (`MediaBudget`), also from headers;
- a video file's bytes, frame size and duration come from its container's headers, checked
  before any frame is decoded (`common.processing.video_file.open_video`), and the frames it
  will give count against the same budget;
- prompt tokens + `max_tokens` against the model's context
  (`common.models.prompt_check.check_context`, which the KV workers call too).
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from common.errors import FieldError

# PIL holds every RGB / RGBA pixel in 4 bytes, and every item is converted to RGB (an
# image may take more while it decodes: `common.processing.image.bytes_per_pixel`).
DECODED_BYTES_PER_PIXEL = 4
# The image formats the router decodes by default (`[router] image_formats`): those clients
# send (`epd.request.IMAGE_SUFFIXES`, OpenAI's PNG, JPEG, WEBP and GIF), not every one PIL
# has a decoder for (43 in Pillow 13: EPS runs Ghostscript, and FITS, PSD, SGI, DDS ... are
# rarely asked of a model and each a decoder an attacker could aim at).
IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

# The frame rates a video may declare: below MIN_FPS its timestamps in the prompt grow
# without bound (a rate of 1e-300 writes 300-digit seconds), and the frame count sampled
# from it overflows; above MAX_FPS no camera records.
MIN_FPS = 1e-3
MAX_FPS = 1e4
# The most pixels of one image or video frame a server decodes, whatever max_image_pixels
# says (8192 x 8192; PIL's own decompression-bomb bound is higher).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def check_fps(fps: float) -> float:
    """`fps` when a video may declare it (MIN_FPS <= fps <= MAX_FPS), else ValueError."""
    if not MIN_FPS <= fps <= MAX_FPS:  # NaN fails too
        raise ValueError(f"video fps must be within [{MIN_FPS:g}, {MAX_FPS:g}], got {fps}")
    return fps


class LimitError(FieldError):
    """A request over one of the `InputLimits`; `field` names the request field."""


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Sizes one request may have; None: unlimited."""

    max_text_bytes: int | None = None  # UTF-8 bytes of all text parts and roles
    max_image_pixels: int | None = None  # width * height of one image or video frame
    max_video_frames: int | None = None  # frames of one video
    max_media_bytes: int | None = None  # decoded pixel bytes of all images and frames
    max_video_file_bytes: int | None = None  # bytes of one video container file
    max_video_seconds: float | None = None  # duration of one video file, from its header
    max_video_decoded_pixels: int | None = None  # pixels decoded from one video file
    video_file_fps: float = 2.0  # rate a video file is sampled at when its request says 0
    image_formats: tuple[str, ...] | None = None  # PIL formats an image may be in (None: any)
    max_model_len: int | None = None  # prompt tokens + max_tokens


def check_text_bytes(used: int, limits: InputLimits, field: str) -> None:
    """Refuse when `used` text bytes (the total so far, up to `field`) exceed the limit."""
    if limits.max_text_bytes is not None and used > limits.max_text_bytes:
        raise LimitError(
            field,
            f"prompt text of {used}+ bytes exceeds max_prompt_text_bytes = {limits.max_text_bytes}",
        )


def check_image_header(image: Image.Image, limits: InputLimits, field: str) -> None:
    """Refuse an opened, not yet decoded image whose header size exceeds the pixel limit."""
    pixels = image.width * image.height
    if limits.max_image_pixels is not None and pixels > limits.max_image_pixels:
        raise LimitError(
            field,
            f"image of {image.width}x{image.height} = {pixels} pixels exceeds "
            f"max_image_pixels = {limits.max_image_pixels}",
        )


def check_video_frames(count: int, limits: InputLimits, field: str) -> None:
    """Refuse a video of more frames than the limit (before opening any)."""
    if limits.max_video_frames is not None and count > limits.max_video_frames:
        raise LimitError(
            field, f"video of {count} frames exceeds max_video_frames = {limits.max_video_frames}"
        )


class MediaBudget:
    """Bytes one request's media take, summed from headers as items open: their decoded
    pixels, and the patch codes processing will make of them (`router.media_cost`), and
    the most one item takes beside those while it is decoded or processed."""

    def __init__(self, limits: InputLimits) -> None:
        self.limit = limits.max_media_bytes
        self.used = 0  # bytes of the items added so far
        self.transient = 0  # the most one item takes for a while, beside what is kept
        self._item = 0  # what the item begun last takes for a while (`begin`, `add`)

    @property
    def total(self) -> int:
        """What the request's media take at most: their bytes, and one item's transient
        bytes (items are decoded, then processed, one at a time)."""
        return self.used + self.transient

    def begin(self) -> None:
        """An item begins: what its images or frames take for a while (`add`) is counted
        apart from what the items before took."""
        self._item = 0

    def add(
        self,
        width: int,
        height: int,
        field: str,
        per_pixel: int = DECODED_BYTES_PER_PIXEL,
        transient_per_pixel: int = 0,
    ) -> None:
        """Count one image or frame of `per_pixel` bytes a pixel once decoded, which takes
        `transient_per_pixel` more for a while (an image's:
        `common.processing.image.bytes_per_pixel`), the item's most so far; refuse when
        the request's total passes the limit. (A video's frames each take it while made
        RGB: the last frame's alone under-counted frames with transparency before a plain
        one by up to 4 bytes a pixel; s35diff review.)"""
        self._item = max(self._item, width * height * transient_per_pixel)
        self.transient = max(self.transient, self._item)
        self.add_bytes(width * height * per_pixel, field)

    def briefly(self, nbytes: int, field: str, alone: bool = False) -> None:
        """Count `nbytes` more that the item begun last takes for a while (while it is
        processed: `router.media_cost`), or that an item takes `alone` (nothing else of it
        held then); refuse when the request's total passes the limit."""
        self.transient = max(self.transient, nbytes if alone else self._item + nbytes)
        self.add_bytes(0, field)

    def add_bytes(self, nbytes: int, field: str) -> None:
        """Count `nbytes` more of the request's media (what processing them will make, say);
        refuse when the total passes the limit."""
        self.used += nbytes
        if self.limit is not None and self.total > self.limit:
            raise LimitError(
                field,
                f"decoded media of the request reach {self.total} bytes, more than "
                f"max_media_bytes = {self.limit}",
            )
