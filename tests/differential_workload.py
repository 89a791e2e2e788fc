"""The differential test's workload (`tests/test_differential.py`): seeded sessions of text,
odd-sized images, videos grown by appended frames, media repeated across and within requests,
multi-turn chats and bursts; `workload()` rebuilds the same sessions from the same seed."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from common.sampling import SamplingParams

SEED = 20240607
# Words of the prompts' text, accents, CJK and an emoji among them.
VOCABULARY = (
    "the a cat dog video frame image what where why describe colour shape left right moves "
    "first last tell me about this picture quickly please ok yes no red blue green car tree "
    "house sky 12 7 3.5 , . ? ! ü é 漢字 🙂"
)
FPS = (0.5, 1.0, 2.0, 2.0, 3.0, 7.3, 24.0)  # 2.0 is the processor's sampling rate
# (width, height, mode) of the shared images: tiny, wide and tall near the aspect limit (200),
# ordinary, larger than the processor's most pixels, with alpha and grey.
IMAGE_SIZES = (
    (1, 1, "RGB"),
    (5, 3, "RGB"),
    (600, 4, "RGB"),
    (2, 390, "RGB"),
    (64, 48, "RGB"),
    (131, 97, "RGB"),
    (300, 220, "RGB"),
    (40, 30, "RGBA"),
    (33, 65, "L"),
)
# (frames, width, height) of the shared videos.
VIDEO_SHAPES = ((9, 64, 48), (4, 32, 32), (1, 80, 6), (6, 40, 56))
# Session kinds and how many of each the workload holds (about 50 requests in all).
KINDS = {"text": 8, "images": 12, "video": 6, "grow": 3, "chat": 3, "burst": 2}


@dataclass(frozen=True, slots=True)
class Request:
    """One chat request of the workload."""

    index: int  # position in the workload, which a mismatch names
    description: str  # what the request holds, for a mismatch message
    messages: list[dict[str, Any]]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class Session:
    """Requests one client sends one after another, or all at once (`burst`)."""

    requests: list[Request]
    burst: bool = False


@dataclass(frozen=True, slots=True)
class Media:
    """A chat part and how a mismatch message names it."""

    part: dict[str, Any]
    name: str


class WorkloadBuilder:
    """Builds the seeded sessions. Media objects are shared between requests (and sometimes
    copied: same pixels, another object), so repeats find what earlier requests cached."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.count = 0  # requests built so far: the next one's index
        self.words = VOCABULARY.split()
        self.images = [self.image(w, h, mode) for w, h, mode in IMAGE_SIZES]
        self.videos = [self.pixels((t, h, w, 3)) for t, w, h in VIDEO_SHAPES]

    def pixels(self, shape: tuple[int, ...]) -> np.ndarray:
        """Random uint8 pixels of `shape`, from the workload's seed."""
        return np.random.default_rng(self.rng.randrange(1 << 30)).integers(0, 256, shape, np.uint8)

    def image(self, width: int, height: int, mode: str) -> Image.Image:
        channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
        arr = self.pixels((height, width, channels))
        return Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)

    def text(self, lo: int = 1, hi: int = 10) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(self.rng.randint(lo, hi)))

    def sampling(self) -> SamplingParams:
        """Greedy; up to 16 tokens; stopping at the end-of-sequence token half the time."""
        return SamplingParams(
            max_tokens=self.rng.randint(1, 16), ignore_eos=self.rng.random() < 0.5
        )

    def pick_image(self) -> Media:
        """A shared image: itself, or a copy of its pixels (the content hash must match)."""
        i = self.rng.randrange(len(self.images))
        w, h, mode = IMAGE_SIZES[i]
        image, name = self.images[i], f"img{i} {w}x{h} {mode}"
        if self.rng.random() < 0.2:
            image, name = image.copy(), name + " (copy)"
        return Media({"type": "image", "image": image}, name)

    def video(self, frames: np.ndarray, fps: float, name: str) -> Media:
        """A video part: the frames as one array or as a list of images."""
        as_list = self.rng.random() < 0.5
        video: Any = [Image.fromarray(f) for f in frames] if as_list else frames
        form = "list" if as_list else "array"
        return Media({"type": "video", "video": video, "fps": fps}, f"{name} @{fps}fps {form}")

    def pick_video(self) -> Media:
        i = self.rng.randrange(len(self.videos))
        frames = self.videos[i]
        return self.video(frames, self.rng.choice(FPS), f"vid{i} {len(frames)} frames")

    def grown(self, frames: np.ndarray, most: int = 9) -> np.ndarray:
        """`frames` with 1 to 3 new frames appended (at most `most` in all)."""
        extra = self.pixels((self.rng.randint(1, 3), *frames.shape[1:]))
        return np.concatenate([frames, extra])[:most]

    def content(self, media: list[Media]) -> tuple[list[dict[str, Any]], list[str]]:
        """User content: `media` in order, random text before some and after the last."""
        parts: list[dict[str, Any]] = []
        for m in media:
            if self.rng.random() < 0.6:
                parts.append({"type": "text", "text": self.text()})
            parts.append(m.part)
        if not media or self.rng.random() < 0.8:
            parts.append({"type": "text", "text": self.text()})
        return parts, [m.name for m in media]

    def user_turn(self) -> tuple[Any, list[str]]:
        """A user message's content: text only, images, or a video with maybe an image."""
        kind = self.rng.random()
        if kind < 0.3:
            return self.text(1, 20), []
        if kind < 0.65:
            return self.content([self.pick_image() for _ in range(self.rng.randint(1, 2))])
        return self.content([self.pick_image(), self.pick_video()][self.rng.randint(0, 1) :])

    def request(self, kind: str, messages: list[dict[str, Any]], media: list[str]) -> Request:
        sampling = self.sampling()
        held = ", ".join(media) if media else "text only"
        description = (
            f"{kind}: {held}; max_tokens {sampling.max_tokens}, ignore_eos {sampling.ignore_eos}"
        )
        self.count += 1
        return Request(self.count - 1, description, messages, sampling)

    def session(self, kind: str) -> Session:
        if kind == "text":
            messages = [{"role": "user", "content": self.text(1, 24)}]
            if self.rng.random() < 0.4:
                messages.insert(0, {"role": "system", "content": self.text()})
            return Session([self.request(kind, messages, [])])
        if kind == "images":
            chosen = [self.pick_image() for _ in range(self.rng.randint(1, 3))]
            if self.rng.random() < 0.3:
                chosen.append(chosen[0])  # the same image twice in one request
            parts, names = self.content(chosen)
            return Session([self.request(kind, [{"role": "user", "content": parts}], names)])
        if kind == "video":
            media = [self.pick_video()]
            if self.rng.random() < 0.4:
                media.insert(0, self.pick_image())
            parts, names = self.content(media)
            return Session([self.request(kind, [{"role": "user", "content": parts}], names)])
        if kind == "grow":
            return self.grow_session()
        if kind == "chat":
            return self.chat_session()
        return self.burst_session()

    def grow_session(self) -> Session:
        """A new video asked about, then asked about again with frames appended."""
        height = self.rng.randint(8, 80)
        frames = self.pixels((self.rng.randint(1, 5), height, 40, 3))
        fps, before, question = self.rng.choice(FPS), self.text(), self.text()
        requests = []
        for step in range(self.rng.randint(2, 3)):
            name = f"new video 40x{height} {len(frames)} frames (step {step})"
            video = self.video(frames, fps, name)
            parts = [{"type": "text", "text": before}, video.part]
            parts.append({"type": "text", "text": question})
            requests.append(
                self.request("grow", [{"role": "user", "content": parts}], [video.name])
            )
            frames = self.grown(frames)
        return Session(requests)

    def chat_session(self) -> Session:
        """2 to 3 turns, each request the whole conversation so far."""
        messages: list[dict[str, Any]] = []
        if self.rng.random() < 0.5:
            messages.append({"role": "system", "content": self.text()})
        requests, names = [], []
        for turn in range(self.rng.randint(2, 3)):
            content, media = self.user_turn()
            names += media
            messages = [*messages, {"role": "user", "content": content}]
            requests.append(self.request(f"chat turn {turn}", list(messages), list(names)))
            messages = [*messages, {"role": "assistant", "content": self.text(1, 12)}]
        return Session(requests)

    def burst_session(self) -> Session:
        """3 to 4 requests on the same video (and maybe image), sent at once: identical,
        with more text, or with frames appended."""
        i = self.rng.randrange(len(self.videos))
        frames, fps = self.videos[i], self.rng.choice(FPS)
        image = self.pick_image() if self.rng.random() < 0.5 else None
        lead = self.text()
        requests = []
        for _ in range(self.rng.randint(3, 4)):
            variant = self.rng.choice(("same", "more text", "grown"))
            video = frames if variant != "grown" else self.grown(frames, most=12)
            v = self.video(video, fps, f"vid{i} {len(video)} frames")
            media = [v] if image is None else [image, v]
            parts = [{"type": "text", "text": lead}, *(m.part for m in media)]
            if variant == "more text":
                parts.append({"type": "text", "text": self.text()})
            names = [m.name for m in media]
            messages = [{"role": "user", "content": parts}]
            requests.append(self.request(f"burst ({variant})", messages, names))
        return Session(requests, burst=True)


def workload(seed: int = SEED) -> list[Session]:
    """The sessions of the test, in the order they are started; requests are numbered
    0, 1, ... in that order."""
    builder = WorkloadBuilder(seed)
    kinds = [kind for kind, n in KINDS.items() for _ in range(n)]
    builder.rng.shuffle(kinds)
    return [builder.session(kind) for kind in kinds]
