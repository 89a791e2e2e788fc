"""`image.to_rgb` gives the bytes of the reference's conversion (every mode to RGBA,
composited onto opaque white with `alpha_composite`, then RGB) for every value and alpha
pair of each mode with transparency, while it composites by a paste through the alpha."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from common.processing.image import to_rgb


def reference(image: Image.Image) -> np.ndarray:
    """The reference processor's RGB conversion."""
    if image.mode == "RGB":
        return np.asarray(image)
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))


def every_pair() -> tuple[np.ndarray, np.ndarray]:
    """Every (value, alpha) byte pair, as a 256 x 256 grid each."""
    value, alpha = np.meshgrid(np.arange(256), np.arange(256))
    return value.astype(np.uint8), alpha.astype(np.uint8)


def test_rgba_and_la_match_the_reference_for_every_value_and_alpha() -> None:
    value, alpha = every_pair()
    rgba = Image.fromarray(np.stack([value, 255 - value, value // 3, alpha], -1), "RGBA")
    la = Image.fromarray(np.stack([value, alpha], -1), "LA")
    for image in (rgba, la):
        out = to_rgb(image)
        assert out.mode == "RGB" and out.size == image.size
        assert np.array_equal(np.asarray(out), reference(image)), image.mode


@pytest.mark.parametrize("mode", ["P", "L", "PA", "RGB"])
def test_palette_grey_and_transparent_index_images_match_the_reference(mode: str) -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (32, 48), dtype=np.uint8)
    if mode in ("P", "PA"):
        image = Image.fromarray(pixels, "L").convert("P")
        image.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tobytes())
        if mode == "PA":
            image = image.convert("PA")
        else:
            image.info["transparency"] = int(pixels[0, 0])  # one index transparent
    elif mode == "L":
        image = Image.fromarray(pixels, "L")
    else:
        image = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8), "RGB")
    assert np.array_equal(np.asarray(to_rgb(image)), reference(image))
