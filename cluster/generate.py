"""`epd generate`: one chat turn (text, images, videos) streamed from a running router, then
its timings and cache statistics."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.console import say as _say


def frame_files(folder: str | Path) -> list[Path]:
    """The image files of a frames folder, in name order (`epd.request.frame_files`);
    ValueError naming `--video` when there are none."""
    from epd.request import frame_files as files

    if not Path(folder).is_dir():
        raise ValueError(f"--video {folder}: neither a video file nor a folder of frame images")
    return files(folder, where="--video")


FOLDER_FPS = 2.0  # the frame rate of a --video folder given no --fps


def build_messages(
    prompt: str,
    images: Sequence[str | Path] = (),
    videos: Sequence[str | Path] = (),
    *,
    fps: float | None = None,
    system: str | None = None,
) -> list[dict[str, Any]]:
    """The chat for one user turn: images, then videos (each a video file, sampled at `fps`
    or else the router's `video_file_fps`, or a frames folder at `fps` or else
    `FOLDER_FPS`), then text."""
    content: list[dict[str, Any]] = []
    for image in images:
        content.append({"type": "image", "image": Path(image).read_bytes()})
    for video in videos:
        if Path(video).is_file():
            part: dict[str, Any] = {"type": "video", "video": Path(video).read_bytes()}
            if fps is not None:
                part["fps"] = fps
            content.append(part)
            continue
        frames = [p.read_bytes() for p in frame_files(video)]
        content.append({"type": "video", "video": frames, "fps": fps or FOLDER_FPS})
    content.append({"type": "text", "text": prompt})
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    messages.append({"role": "user", "content": content})
    return messages


async def cmd_generate(args: argparse.Namespace) -> int:
    """Stream the answer, then one line of timing and cache statistics."""
    from common.sampling import SamplingParams
    from epd.client import generate

    try:
        if args.fps is not None and not args.fps > 0:  # also NaN
            raise ValueError(f"--fps: must be positive, got {args.fps:g}")
        messages = build_messages(
            args.prompt, args.image, args.video, fps=args.fps, system=args.system
        )
    except OSError as exc:  # a file of --image or --video (a frame of a --video folder)
        images = [str(Path(image)) for image in args.image or ()]  # as opened (./a: a)
        flag = "--image" if str(exc.filename) in images else "--video"
        _say(f"epd: {flag} {exc.filename}: {exc.strerror or exc}")
        return 2
    except ValueError as exc:
        _say(f"epd: {exc}")
        return 2
    try:
        sampling = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
        )
    except ValueError as exc:  # it names the field: "max_tokens must be ..."
        name = str(exc).split(" ", 1)[0]
        flag = (
            f"--{name.replace('_', '-')}: " if name in ("temperature", "max_tokens", "seed") else ""
        )
        _say(f"epd: {flag}{exc}")
        return 2
    t0 = time.monotonic()
    ttft = 0.0
    tokens = 0
    finish = ""
    stats = dict.fromkeys(("prompt_tokens", "cached_tokens", "blocks_reused", "blocks_pulled"), 0)
    from common.settings.api_keys import CLIENT_KEY_FILE, default_api_key

    key = args.api_key or default_api_key(CLIENT_KEY_FILE)
    async for chunk in generate(
        args.address,
        messages,
        sampling,
        api_key=key,
        tls_ca_file=args.tls_ca_file,
        stop=args.stop,
    ):
        if tokens == 0 and chunk.token_ids:
            ttft = time.monotonic() - t0
        tokens += len(chunk.token_ids)
        # The first chunk (prefill) carries the prompt counts, the first decode chunk the
        # KV block counts.
        for key, value in stats.items():
            stats[key] = value or getattr(chunk, key)
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        finish = chunk.finish_reason or finish
    total = time.monotonic() - t0
    sys.stdout.write("\n")
    if tokens == 0:
        _say("(no answer)")
        return 1
    decode_s = total - ttft
    # One token: no rate after the first ("0.0 tokens/s" read as a stall).
    rate = ""
    if tokens > 1 and decode_s > 0:
        rate = f"{(tokens - 1) / decode_s:.1f} tokens/s after the first, "
    _say(
        f"--- {tokens} tokens ({finish or 'unfinished'}); TTFT {ttft * 1000:.0f} ms, "
        f"{rate}{total:.2f} s total"
    )
    _say(
        f"--- prompt {stats['prompt_tokens']} tokens, {stats['cached_tokens']} from prefix "
        f"cache; KV blocks at decode: {stats['blocks_reused']} reused, "
        f"{stats['blocks_pulled']} pulled"
    )
    return 0
