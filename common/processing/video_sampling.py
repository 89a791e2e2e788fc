"""Which frames of a video file its sampling keeps, and how many it will keep.

A file sampled at `fps` has sample times every `1 / fps` seconds (`sample_times`; at most
`max_frames`, spread over the duration where more). As the file decodes, a frame is kept
for the first sample time no kept frame covers once the frame is within half a source
frame of it, and covers every sample time up to half a source frame after it (`Sampling`),
so no frame is kept twice and a source slower than `fps` leaves sample times without one.

`kept_from_packets` runs the same rule over the times of a file's packets, demuxed but not
decoded: how many frames decoding will keep, known before it starts, so the processor's
plan of them (`common.processing.frame_store.PlannedStore`) is made once (planned for every
sample time, a file that kept fewer was decoded a second time: ownfixA review, s42).
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Iterable
from typing import Any

import av

from common.errors import FieldError
from common.processing.limits import MIN_FPS

REORDER_DEPTH = 16  # the most frames a decoder holds back to show in order (H.264, HEVC)


class Sampling:
    """The keep rule of one file's sample times (module docstring)."""

    def __init__(self, targets: tuple[float, ...], duration_s: float, rate: float | None) -> None:
        self.targets = targets  # the sample times, seconds from the stream's start
        # A frame stands for the sample times up to half a source frame after it (at most
        # half the sampling interval, whatever rate the header claims).
        spacing = targets[1] - targets[0] if len(targets) > 1 else duration_s
        self.half = min(0.5 / rate if rate else 1e-3, 0.5 * spacing)
        self.next = 0  # the first sample time no kept frame covers

    def keeps(self, t: float) -> bool:
        """Whether the frame at `t` seconds (frames in time order) is kept."""
        if t + self.half < self.targets[self.next]:
            return False
        while self.next < len(self.targets) and self.targets[self.next] <= t + self.half:
            self.next += 1
        return True

    @property
    def done(self) -> bool:
        """Every sample time is covered: decoding may stop."""
        return self.next == len(self.targets)


def kept_from_packets(
    packets: Iterable[av.Packet], stream: Any, sampling: Sampling, start: float, most: int
) -> int | None:
    """How many frames `sampling` keeps of video `stream`, from the presentation times of
    its `packets` (demuxed, nothing decoded), from its first keyframe on (a decoder drops
    what comes before it: a recording cut mid-GOP; ownfixB review, s42). The packets are
    read until the sampling is done, as decoding stops there (no packet is shown before it
    is decoded, and decoding is in order: the times before a packet's decoding time are
    final; a file giving no decoding times is read to its end), and `REORDER_DEPTH` more,
    to the end where one shows those decoding times were guessed. None where a packet has no
    time, past `most` packets (decoding refuses such a stream), where the demuxer fails (a
    corrupt tail decoding may never reach) and where none is kept: planned for every
    sample time then."""
    fresh = copy.copy(sampling)  # for a count over every time, where decoding times lied
    times: list[float] = []  # every time counted
    pending: list[float] = []  # times not yet run through the rule, a heap
    kept, last, ordered = 0, -math.inf, True  # `last`: the latest time run through it
    past = 0  # packets read once the sampling was done
    keyed, first = False, 0
    try:
        for packet in packets:
            if not keyed and packet.is_keyframe and packet.pts is not None:
                keyed, first = True, packet.pts
            if not packet.size or not keyed or packet.is_discard:  # (size 0: the end)
                continue
            if packet.pts is None or len(times) == most:
                return None
            if packet.pts < first:
                continue
            times.append(float(packet.pts * stream.time_base) - start)
            # One shown before a time already counted: its decoding times were guessed
            # (FFmpeg's, for some mkv files; ownfixB review, s43): read to the end, sorted.
            # Done, a decoder's reordering depth more is read to see that (ownfixC, s43).
            ordered = ordered and times[-1] >= last
            if not ordered:
                continue
            if sampling.done:
                past += 1
                if past > REORDER_DEPTH:
                    return kept
                continue
            heapq.heappush(pending, times[-1])
            if packet.dts is None:
                continue
            decoded = float(packet.dts * stream.time_base) - start
            while pending and pending[0] <= decoded and not sampling.done:
                last = heapq.heappop(pending)
                kept += sampling.keeps(last)
    except FieldError:
        raise  # (the request ended)
    except (av.FFmpegError, OSError, ValueError, EOFError):  # past what decoding reads, maybe
        return None
    if not ordered:
        kept, sampling, pending = 0, fresh, times
        heapq.heapify(pending)
    while pending and not sampling.done:
        kept += sampling.keeps(heapq.heappop(pending))
    return kept or None


def kept_rate(duration_s: float, fps: float, kept: int) -> float:
    """The rate `kept` frames of a file sampled at `fps` stand for: `fps` when each of its
    sample times got a frame, else (a source slower than `fps`, or `max_frames` spreading
    them) as many frames as its duration holds; the processor reads a video's length as
    frames / rate, and would otherwise take it for shorter and drop frames."""
    if kept == max(1, math.ceil(duration_s * fps - 1e-9)):
        return fps
    return max(kept / duration_s, MIN_FPS) if duration_s > 0 else fps


def sample_times(duration_s: float, fps: float, max_frames: int) -> tuple[float, ...]:
    """Seconds of the frames to keep: every `1 / fps` in `[0, duration)`, or `max_frames`
    spread uniformly over the duration when that is fewer."""
    count = max(1, math.ceil(duration_s * fps - 1e-9))
    if count <= max_frames:
        return tuple(k / fps for k in range(count))
    return tuple(k * duration_s / max_frames for k in range(max_frames))
