"""Qwen3-VL image preprocessing: decode, smart resize, patchify, rescale + normalise.

Matches the reference PIL image processor (`transformers` `Qwen2VLImageProcessorPil`, which
Qwen3-VL uses) value for value: RGB with transparency composited on white, bicubic PIL
resize of the uint8 image to sides that are multiples of `patch_size * merge_size` within
the pixel budget, scale by 1/255 (in float64, then float32), `(x - mean) / std` in float32.

In two steps, so that what travels and is hashed is a quarter of the bytes:
- `patch_codes`: the resized uint8 pixels put in patch-row order ("patch codes"), what the
  processor makes, the content hash covers and the router sends the encoder;
- `patch_values`: codes -> the float32 rows the vision tower takes (the reference's
  `pixel_values`), made where the tower runs (`as_patch_values`). Every value is a function
  of one byte and its channel (which the settings' fingerprint covers), so codes name their
  values exactly.

Patch rows are laid out as the vision tower expects: frame-major (temporal patches), then
`merge_size x merge_size` blocks in raster order, then the patches inside a block in raster
order; each row flattens one patch as `(channel, time, row, column)`.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image, ImageOps

from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.processing.limits import DECODED_BYTES_PER_PIXEL

FloatArray = npt.NDArray[np.float32]
ByteArray = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True, eq=False)
class KeyedImage:
    """Encoded image bytes with their processed-image cache key
    (`common.processing.image_cache.image_key`), and the image decoded from them where it
    was (None: the cache held the key when the router checked the request, so it was not
    decoded; `load_image` decodes `data` should the entry be gone by processing time)."""

    data: bytes  # the encoded file (PNG, JPEG, ...) as received
    key: bytes  # image_key of `data` under the processor's settings
    image: Image.Image | None = None  # decoded from `data`, or None


ImageSource = bytes | str | Path | Image.Image | npt.NDArray[np.uint8] | KeyedImage


def load_image(source: ImageSource | Any) -> Image.Image:
    """Open encoded bytes, a file path, a PIL image, a `KeyedImage` or an `(H, W[, C])` uint8
    array."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, KeyedImage):
        return source.image if source.image is not None else load_image(source.data)
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim not in (2, 3):
            raise ValueError(
                f"image array must be (H, W[, C]) uint8, got {source.dtype} {source.shape}"
            )
        return Image.fromarray(
            source.squeeze(-1) if source.ndim == 3 and source.shape[-1] == 1 else source
        )
    if isinstance(source, bytes | bytearray | memoryview):
        image = Image.open(io.BytesIO(bytes(source)))
    elif isinstance(source, str | Path):
        image = Image.open(source)
    else:
        raise TypeError(f"unsupported image source {type(source).__name__}")
    image.load()
    release_decoder(image)  # before it is turned and made RGB (`bytes_per_pixel`)
    return image


_ORIENTATION = 0x0112  # the EXIF tag: how to turn the stored pixels to show them


def upright(image: Image.Image) -> Image.Image:
    """The image as it is meant to be shown: turned by its EXIF orientation, as browsers
    and transformers' `load_image` do (a phone's portrait photo is stored landscape).
    Images only: video frames keep their stored orientation, as their file's frames do."""
    try:
        if image.getexif().get(_ORIENTATION, 1) == 1:
            return image
        return ImageOps.exif_transpose(image)
    except Exception:  # malformed EXIF (struct.error, ...): metadata; the pixels decoded
        return image


# Pillow decodes every WebP, a still one too, through its animation decoder: two RGBA
# canvases and the frame's bytes beside the decoded image, 12 bytes a pixel more while it
# decodes, and kept with it unless let go (`release_decoder`).
WEBP_DECODER_BYTES_PER_PIXEL = 12


def release_decoder(image: Image.Image) -> None:
    """Let go of what a decoded WebP's decoder holds (12 bytes a pixel: a 768-frame WebP
    video held three times its pixels; ownfix review). Pillow's attributes: nothing if
    they are gone."""
    if image.format == "WEBP" and getattr(image, "_decoder", None) is not None:
        image._decoder = None  # type: ignore[attr-defined]
        image.fp = None  # type: ignore[attr-defined]


def bytes_per_pixel(image: Image.Image) -> tuple[int, int]:
    """Bytes a pixel of an opened, not yet decoded image takes once decoded (4), and the
    most it takes beside that for a while, one image at a time: while it decodes (a
    progressive JPEG's coefficients, 2 bytes a band: libjpeg holds them all until the last
    scan; WebP's decoder, until `release_decoder`), or while it is made upright and RGB
    (the copy an EXIF turn makes, `upright`; the white canvas transparency is composited
    on and an RGBA or RGB copy of an image in another mode, `to_rgb`). A request's images
    are decoded, then processed, one after another: the second number is counted once a
    request, at its largest (`MediaBudget.add`). From the header alone: a PNG's EXIF
    stored after its pixels is not seen (reading it decodes them)."""
    bands = image.getbands()
    decoding = 0
    if image.format == "JPEG" and (image.info.get("progressive") or image.info.get("progression")):
        decoding = 2 * len(bands)
    elif image.format == "WEBP":
        decoding = WEBP_DECODER_BYTES_PER_PIXEL
    processing = 0
    if "A" in bands or image.info.get("transparency") is not None:
        processing += 4 + 4 * (image.mode != "RGBA")  # the canvas, and the RGBA copy
    elif image.mode != "RGB":
        processing += 4  # the RGB copy
    if image.info.get("exif"):
        try:
            exif = Image.Exif()
            exif.load(image.info["exif"])
            processing += 4 * (exif.get(_ORIENTATION, 1) != 1)
        except Exception:  # malformed EXIF: `upright` leaves such an image as it is
            pass
    return DECODED_BYTES_PER_PIXEL, max(decoding, processing)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as the reference does). An RGB
    image is returned as it is: `convert` to its own mode copies it, and that copy (a
    4096x4096 JPEG's is 67 MB) doubled what processing an image held at its peak.

    Transparency is composited by pasting the RGBA image onto a white RGB one through its
    own alpha: the same bytes as the reference's `alpha_composite` onto opaque white, then
    RGB (every value and alpha pair is checked in the tests), with one image-sized buffer
    of 3 bytes a pixel instead of three (4 + 4 + 3)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, (0, 0), rgba)
        return rgb
    return image if image.mode == "RGB" else image.convert("RGB")


MAX_ASPECT_RATIO = 200  # the reference's bound on max(h, w) / min(h, w), images and frames


def check_aspect_ratio(height: int, width: int) -> None:
    """ValueError for a size the reference's resize refuses (no pixels, or a longer side
    over `MAX_ASPECT_RATIO` times the shorter)."""
    if min(height, width) < 1:
        raise ValueError(f"image has no pixels: {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio must be at most {MAX_ASPECT_RATIO}, got {height}x{width}")


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target `(height, width)`: multiples of `factor`, pixel count within the bounds, aspect
    ratio kept as closely as possible (the reference's rule, including its rounding)."""
    check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# Rows of an image copied into an array at a time (`resize_rgb`).
BAND_ROWS = 64


def resize_rgb(image: Image.Image, height: int, width: int) -> ByteArray:
    """Bicubic PIL resize of an RGB image to `(height, width, 3)` uint8, copied out a band
    of rows at a time: `np.asarray` of the whole image went through `tobytes`, which holds
    its bytes twice (10 bytes a resized pixel at the peak, not 7; ownfix review)."""
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    out = np.empty((height, width, 3), dtype=np.uint8)
    for top in range(0, height, BAND_ROWS):
        band = image.crop((0, top, width, min(top + BAND_ROWS, height)))
        out[top : top + band.height] = np.asarray(band, dtype=np.uint8)
    return out


def patch_codes(
    frames: ByteArray, settings: ProcessorSettings
) -> tuple[ByteArray, tuple[int, int, int]]:
    """`(T, H, W, C)` uint8 frames -> `(grid_t * grid_h * grid_w, patch_dim)` uint8 patch
    codes (the bytes laid out as the module docstring says) and the grid
    `(grid_t, grid_h, grid_w)`.

    T is padded to a multiple of `temporal_patch_size` by repeating the last frame (an image
    becomes `temporal_patch_size` identical frames). Each time slot of the codes is written
    from a view of its frames: the padded frames are never made (an image's were twice its
    resized pixels, beside them and the codes).
    """
    tp, p, m = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    t, h, w, c = frames.shape
    if c != len(settings.image_mean):
        raise ValueError(f"frames have {c} channels, the settings {len(settings.image_mean)}")
    if h % (p * m) or w % (p * m):
        raise ValueError(f"frame size {h}x{w} is not a multiple of {p * m}")
    gt, gh, gw = -(-t // tp), h // p, w // p
    # (gt, block_row, block_col, in_row, in_col, channel, time, pixel_row, pixel_col)
    ordered = np.empty((gt, gh // m, gw // m, m, m, c, tp, p, p), dtype=frames.dtype)
    for k in range(tp):
        slot = frames[k::tp]  # time slot k of each patch that has it; the last frame after
        for start, chosen in ((0, slot), (len(slot), frames[-1:])):
            n = len(chosen) if start == 0 else gt - start
            if n:
                blocks = chosen[:n].reshape(n, gh // m, m, p, gw // m, m, p, c)
                ordered[start : start + n, ..., k, :, :] = blocks.transpose(0, 1, 4, 2, 5, 7, 3, 6)
    return ordered.reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


def patch_values(codes: ByteArray, settings: ProcessorSettings) -> FloatArray:
    """`(rows, patch_dim)` uint8 patch codes -> the float32 patch rows, every value scaled
    to [0, 1] and normalised as the reference does per pixel.

    Each value is a function of one byte and its channel, so the codes are mapped through a
    table of that function (`_normalized_bytes`), two bytes at a time (`_byte_pairs`) where
    a row's run of one channel's values has even length: the same bits as the per-pixel
    arithmetic, without its float64 pass and three float32 passes over every pixel. When
    every channel has the same mean and std (Qwen3-VL's 0.5), one lookup over the whole
    array does it (1.1-2.4x faster than a lookup per channel, from 196 K to 50 M codes).
    """
    mean, std = tuple(settings.image_mean), tuple(settings.image_std)
    c = len(mean)
    if codes.dtype != np.uint8 or codes.ndim != 2 or codes.shape[1] % c:
        raise ValueError(
            f"patch codes must be (rows, {c} * run) uint8, got {codes.dtype} {codes.shape}"
        )
    run = codes.shape[1] // c  # the values of one channel in a row: (time, row, column)
    if run % 2 == 0 and len(set(zip(mean, std, strict=True))) == 1:
        pair_codes = np.ascontiguousarray(codes).view(np.uint16)
        return _byte_pairs(mean, std)[0][pair_codes].view(np.float32)
    grouped = np.ascontiguousarray(codes).reshape(-1, c, run)
    rows = np.empty(grouped.shape, dtype=np.float32)
    if run % 2 == 0:
        pairs, wide, pair_codes = (
            _byte_pairs(mean, std),
            rows.view(np.uint64),
            grouped.view(np.uint16),
        )
        for k in range(c):
            wide[:, k] = pairs[k][pair_codes[:, k]]
    else:
        table = _normalized_bytes(mean, std)
        for k in range(c):
            rows[:, k] = table[k][grouped[:, k]]
    return rows.reshape(codes.shape)


def as_patch_values(pixels: torch.Tensor, settings: ProcessorSettings) -> torch.Tensor:
    """What the vision tower takes from `pixels`: `patch_values` of uint8 codes (on the
    CPU), or float rows as they are (sent by a router from before codes, or made
    elsewhere)."""
    if pixels.dtype != torch.uint8:
        return pixels
    return torch.from_numpy(patch_values(pixels.cpu().numpy(), settings))


@functools.lru_cache(maxsize=8)
def _normalized_bytes(mean: tuple[float, ...], std: tuple[float, ...]) -> FloatArray:
    """`[C, 256]` float32: byte value `v` of channel `c` scaled and normalised, exactly as
    the reference's per-pixel arithmetic (`v * (1 / 255)` in float64, to float32, then
    `(x - mean) / std` in float32)."""
    values = np.arange(256, dtype=np.uint8).reshape(256, 1)
    scaled = (values.astype(np.float64) * (1 / 255)).astype(np.float32)
    m = np.asarray(mean, dtype=np.float32)
    d = np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(((scaled - m) / d).T)


@functools.lru_cache(maxsize=8)
def _byte_pairs(mean: tuple[float, ...], std: tuple[float, ...]) -> npt.NDArray[np.uint64]:
    """`[C, 65536]` (1.5 MB for RGB): at the code two adjacent bytes read as one uint16,
    the two float32 values `_normalized_bytes` gives them, in their order, read as one
    uint64 (in this machine's byte order, like the codes): one lookup maps both bytes."""
    table = _normalized_bytes(mean, std)
    both = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)  # code's bytes
    return np.ascontiguousarray(table[:, both]).view(np.uint64).reshape(table.shape[0], -1)


def preprocess_image(
    source: ImageSource | Any, settings: ProcessorSettings
) -> tuple[ByteArray, tuple[int, int, int]]:
    """One image -> patch codes `(grid_h * grid_w, patch_dim)` uint8 and grid `(1, h, w)`,
    turned upright first (`upright`)."""
    image = to_rgb(upright(load_image(source)))
    width, height = image.size
    new_h, new_w = smart_resize(
        height,
        width,
        factor=settings.factor,
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
    )
    pixels = resize_rgb(image, new_h, new_w)
    del image  # an RGB copy made of it: not held beside the codes
    return patch_codes(pixels[None], settings)
