"""`epd make-examples DIR`: the README tour's media, made on the spot (nothing shipped).

    DIR/cat.png     a 256x256 drawing of a cat's face (an image for `--image`)
    DIR/clip/       8 frames, frame_00.png ... frame_07.png: the cat turning from day to
                    night (a frame folder for `--video`, with `--fps`)
    DIR/clip.mp4    the same 8 frames as an H.264 (else MPEG-4) file at 2 frames per second

The pictures are deterministic, so two runs write the same image and frame files (the
prefix cache in the tour then hits across runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FRAMES = 8
FPS = 2
SIZE = 256


def cat(sky: tuple[int, ...] = (135, 190, 235), turn: int = 0) -> Any:
    """A cat's face on a `sky`-coloured ground, its eyes looking `turn` pixels aside."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), sky)
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 200, SIZE, SIZE), fill=(90, 160, 80))  # grass
    draw.polygon([(60, 100), (80, 30), (120, 80)], fill=(230, 140, 50))  # ears
    draw.polygon([(196, 100), (176, 30), (136, 80)], fill=(230, 140, 50))
    draw.ellipse((50, 60, 206, 216), fill=(240, 150, 60))  # head
    for x in (95, 161):  # eyes and pupils
        draw.ellipse((x - 16, 110, x + 16, 142), fill=(250, 250, 240))
        draw.ellipse((x - 6 + turn, 118, x + 6 + turn, 134), fill=(20, 20, 20))
    draw.polygon([(118, 160), (138, 160), (128, 172)], fill=(200, 80, 100))  # nose
    for dy in (-6, 4):  # whiskers
        draw.line((40, 165 + dy, 105, 168), fill=(60, 40, 30), width=2)
        draw.line((216, 165 + dy, 151, 168), fill=(60, 40, 30), width=2)
    return image


def frames() -> list[Any]:
    """The clip: the sky darkens from day to night while the cat looks left to right."""
    out = []
    for k in range(FRAMES):
        t = k / (FRAMES - 1)
        day, night = (135, 190, 235), (20, 25, 70)
        sky = tuple(int(d * (1 - t) + n * t) for d, n in zip(day, night, strict=True))
        out.append(cat(sky, turn=int(-8 + 16 * t)))
    return out


def write_mp4(path: Path, images: list[Any], fps: int = FPS) -> None:
    """`images` as a video file (H.264 when this PyAV has it, else MPEG-4 part 2)."""
    import av
    import numpy as np

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = SIZE, SIZE, "yuv420p"
        for image in images:
            frame = av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_examples(folder: str | Path) -> list[Path]:
    """Write cat.png, clip/ and clip.mp4 into `folder` (made if missing); the paths written."""
    root = Path(folder)
    clip = root / "clip"
    clip.mkdir(parents=True, exist_ok=True)
    cat().save(root / "cat.png")
    images = frames()
    for k, image in enumerate(images):
        image.save(clip / f"frame_{k:02d}.png")
    write_mp4(root / "clip.mp4", images)
    return [root / "cat.png", clip, root / "clip.mp4"]
