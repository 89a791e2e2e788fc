"""Video container files (mp4, webm, mkv) decoded with PyAV into timed frames.

`open_video` reads only the file's headers and checks them against the caller's limits
before a single frame is decoded (DESIGN §7, limits come before work):
- the file's bytes (`max_bytes`), before FFmpeg sees them;
- the container kind, from its magic bytes: ISO base media (mp4, mov) or Matroska (mkv,
  webm), opened with that demuxer only, so no other demuxer (playlists, concat lists that
  open further files) ever reads the bytes;
- of an mp4, the samples its boxes declare, before FFmpeg indexes them
  (`common.processing.iso_boxes.check_mp4`: within its bytes, and its video within
  `max_seconds` at `MAX_SOURCE_RATE`); then the file is opened without probing its streams
  (no frame of any is decoded) and with at most `MAX_STREAMS` streams;
- the pixels decoded to reach its last sample time (`max_decoded_pixels`: frames decode in
  order, kept or not; a 4 MB file of 600 s at 240 fps sampled twice held a router thread
  for its request's whole timeout), from the header where it states a rate, and while
  decoding;
- the first video stream's width x height (`max_pixels`) and duration (`max_seconds`).

`VideoFile.decode` then samples the stream at `fps`: one frame per `1 / fps` seconds (the
first from half a source frame before each sample time on, never one twice; not always the
nearest in a file of variable rate), or, when that is more than `max_frames`, `max_frames`
times spread uniformly over the duration. Decoding stops at the last sample time and refuses
a stream that holds far more frames than its header says. Each kept frame is converted to
RGB and keeps its time, from the container's presentation timestamps relative to the
stream's start, and is turned upright by the stream's display matrix: `TimedFrames` (or,
planned, `PlannedFrames`: `common.processing.frame_store`), whose times the processor turns
into the `<t seconds>` text between a video's runs.

Every refusal is a `FieldError` naming the caller's field (`LimitError` for a limit,
`VideoFileError` for a file that is not a readable video).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from typing import Any

import av

from common.errors import FieldError
from common.processing.frame_store import PlannedStore, Planner, WholeFrames
from common.processing.frame_turn import upright_frame, upright_size
from common.processing.iso_boxes import MAX_TRACKS, check_mp4
from common.processing.limits import LimitError, check_fps
from common.processing.video import PlannedFrames, TimedFrames, VideoFileError
from common.processing.video_header import (
    MAX_SOURCE_RATE,
    VideoHeader,
    check_decoding,
    check_format,
    check_header,
    read_header,
)
from common.processing.video_sampling import Sampling, kept_from_packets, kept_rate

# Magic bytes -> the one demuxer allowed to read such a file.
_MATROSKA_MAGIC = b"\x1a\x45\xdf\xa3"  # EBML header: mkv, webm
_ISO_BOX_TYPES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")  # mp4, mov
# A stream may hold this many more frames than its header's duration x rate says (rounding,
# variable frame rates) before it is refused as lying about its length.
_FRAME_SLACK = 1.5
_FRAME_SLACK_MIN = 16
_DECODE_ERRORS = (av.FFmpegError, OSError, ValueError, EOFError)
# Opening reads the headers only: FFmpeg's stream probing would otherwise decode the first
# frames of every stream before any limit is checked (20 streams of 8192x8192 in a 4 MB
# file: 25 s and 6 GB), and a file may hold at most `MAX_STREAMS` streams.
MAX_STREAMS = MAX_TRACKS

_OPEN_OPTIONS = {
    "probesize": "32",
    "analyzeduration": "0",
    "fpsprobesize": "0",
    "max_streams": str(MAX_STREAMS),
}
# A stream whose frame size only its first frames tell (MPEG-4 Part 2 beside sound): opened
# again with probing bounded, and decoders refusing frames past the pixel limit.
_SIZE_PROBE_OPTIONS = {**_OPEN_OPTIONS, "probesize": str(1 << 20), "analyzeduration": "1000000"}
_PROBE_MAX_PIXELS = 1 << 26  # the decoders' frame limit then, where the caller gives none


def container_format(data: bytes, field: str) -> str:
    """The PyAV demuxer for a file, from its magic bytes; `VideoFileError` for any other
    kind of file."""
    if data[:4] == _MATROSKA_MAGIC:
        return "matroska"
    if len(data) >= 8 and data[4:8] in _ISO_BOX_TYPES:
        return "mov"
    raise VideoFileError(field, "is not an mp4, mov, webm or mkv file")


class VideoFile:
    """An opened, header-checked video file; nothing is decoded until `decode`. Owns the
    PyAV container: `decode` closes it (so does `close`)."""

    def __init__(
        self,
        container: av.container.InputContainer,
        header: VideoHeader,
        fps: float,
        field: str,
        max_decoded_pixels: int | None = None,
        planner: Planner | None = None,
        reopen: Callable[[], av.container.InputContainer] | None = None,
    ) -> None:
        self._container = container
        self.header = header
        self.fps = fps  # rate the frames are sampled at
        self.field = field  # the request field errors name
        self.max_decoded_pixels = max_decoded_pixels  # None: unlimited
        # The processor's plan of the kept frames (None: every kept frame whole) and how to
        # open the file again, should the frames kept call for another plan.
        self.planner = planner
        self._reopen = reopen
        self._decoded = 0  # frames decoded by `decode`, every pass

    def close(self) -> None:
        """Release the container (idempotent)."""
        self._container.close()

    def decode(self, ended: Callable[[], bool] | None = None) -> TimedFrames | PlannedFrames:
        """Decode up to the last sample time and keep a frame for each sample time:
        whole (`TimedFrames`), or with a `planner`, those the processor samples, resized as
        they decode (`PlannedFrames`: planned for as many frames as its packets' times say
        it keeps, `kept_from_packets`; where the decoder kept another count, planned for
        that and decoded again, each pass within `max_decoded_pixels`, so that a count
        wrong for a codec costs time, never a refusal decoding whole would not make:
        ownfixC, s42). `VideoFileError` naming the field on corrupt data or a stream that is
        not what its header said, or once `ended()` says the request it is for has ended
        (asked before each frame and every 1024 packets read: decoding is linear, and the
        thread it runs on is not cancelled)."""
        try:
            self._decoded = 0  # frames decoded, every pass
            count = len(self.header.sample_times)
            if self.planner is None:
                whole = self._decode(WholeFrames(count, self.field), ended)
                assert whole is not None  # (never planned again)
                return whole
            assert self._reopen is not None
            # How many frames it keeps, from its packets' times: planned once (ownfixA, s42).
            most, start = self._frame_budget(), self._start()
            stream = self._container.streams.video[0]
            packets = self._packets(ended)
            counted = kept_from_packets(packets, stream, self._sampling(), start, most)
            for _ in range(2):
                count = counted or count
                self._container.close()
                self._container = self._reopen()
                store = PlannedStore(count, self._rate(count), self.planner, self.field)
                got = self._decode(store, ended)
                if got is not None:
                    return got
                counted = store.kept  # the decoder kept other frames than its packets said
            raise VideoFileError(self.field, "kept other frames when decoded again")
        except FieldError:
            raise  # already names the field and says what is wrong
        except _DECODE_ERRORS as exc:
            raise VideoFileError(self.field, f"is not a decodable video ({exc})") from None
        finally:
            self.close()

    def _packets(self, ended: Callable[[], bool] | None) -> Iterator[av.Packet]:
        """The first video stream's packets, demuxed with every other stream's so that
        `ended()` is asked every 1024 packets of any (a short video beside a long tail of
        tiny audio packets was read to its end, seconds of a thread, the request gone:
        s42diff review, s43). `VideoFileError` once the request has ended."""
        index = self._container.streams.video[0].index
        for n, packet in enumerate(self._container.demux()):
            if n % 1024 == 1023 and ended is not None and ended():
                raise self._ended()
            if packet.stream.index == index:  # (the end's flush packets: stream_index 0)
                yield packet

    def _ended(self) -> VideoFileError:
        return VideoFileError(
            self.field, "was still decoding when the request ended (client gone or deadline)"
        )

    def _sampling(self) -> Sampling:
        header = self.header
        return Sampling(header.sample_times, header.duration_s, header.rate)

    def _frame_budget(self) -> int:
        """The most frames a stream may hold beside its header's duration and rate."""
        rate = self.header.rate or MAX_SOURCE_RATE
        return max(math.ceil(self.header.duration_s * rate * _FRAME_SLACK), _FRAME_SLACK_MIN)

    def _start(self) -> float:
        stream = self._container.streams.video[0]
        if stream.start_time and stream.time_base:
            return float(stream.start_time * stream.time_base)
        return 0.0

    def _decode(
        self, store: WholeFrames | PlannedStore, ended: Callable[[], bool] | None
    ) -> TimedFrames | PlannedFrames | None:
        header = self.header
        start, sampling = self._start(), self._sampling()
        budget = self._frame_budget()
        times: list[float] = []  # of the frames kept (`store`), one per sample time at most
        decoded = 0  # this pass's
        checked = header.pixel_format  # the last frame format checked
        limit = self.max_decoded_pixels
        for frame in (f for packet in self._packets(ended) for f in packet.decode()):
            if ended is not None and ended():
                raise self._ended()
            decoded += 1
            self._decoded += 1
            if limit is not None and decoded * header.width * header.height > limit:
                raise LimitError(
                    self.field,
                    f"decoding it to {header.sample_times[-1]:.1f} s passed "
                    f"max_video_decoded_pixels = {limit} ({decoded} frames of "
                    f"{header.width}x{header.height})",
                )
            if decoded > budget:
                raise VideoFileError(
                    self.field, f"holds more frames than its header's {header.duration_s:.3f} s"
                )
            if frame.time is None:
                raise VideoFileError(self.field, "has frames without timestamps")
            if (frame.width, frame.height) != (header.width, header.height):
                raise VideoFileError(
                    self.field,
                    f"frame size changes from {header.width}x{header.height} to "
                    f"{frame.width}x{frame.height}",
                )
            if frame.format.name != checked:  # every change: an in-band one too (ownfix E)
                checked = frame.format.name
                check_format(checked, header, self.field)
            if not sampling.keeps(frame.time - start):
                continue
            if store.wants(len(times)):  # (made RGB and turned only then: ownfixA, s42)
                store.keep(len(times), upright_frame(frame))
            else:
                store.check(upright_size(frame))
            times.append(frame.time - start)
            if sampling.done:
                break
        if not times:
            raise VideoFileError(self.field, "has no decodable frames")
        return store.result(times, self._rate(len(times)))

    def _rate(self, kept: int) -> float:
        return kept_rate(self.header.duration_s, self.fps, kept)


def open_video(
    data: bytes,
    *,
    fps: float,
    max_frames: int,
    max_pixels: int | None = None,
    max_bytes: int | None = None,
    max_seconds: float | None = None,
    max_decoded_pixels: int | None = None,
    field: str = "video.file",
    planner: Planner | None = None,
) -> VideoFile:
    """Open a video file and check its headers against the limits (None: unlimited);
    nothing is decoded. `LimitError` for a file over a limit, `VideoFileError` for one that
    is not a readable video, both naming `field`. `planner`: the processor's plan, to keep
    only the frames it samples, resized as they decode (`VideoFile.decode`)."""
    try:
        check_fps(fps)
    except ValueError as exc:
        raise FieldError(field, f"sample rate: {exc}") from None
    if max_frames < 1:
        raise FieldError(field, f"max_frames must be positive, got {max_frames}")
    if not data:
        raise VideoFileError(field, "is empty")
    if max_bytes is not None and len(data) > max_bytes:
        raise LimitError(
            field, f"video file of {len(data)} bytes exceeds max_video_file_bytes = {max_bytes}"
        )
    kind = container_format(data, field)
    if kind == "mov":
        check_mp4(data, max_seconds, MAX_SOURCE_RATE, _FRAME_SLACK, field)

    def reopen() -> av.container.InputContainer:
        try:
            # The decoders refuse frames past the pixel limit: opening still decodes the
            # first frame of the first stream (an 8000x8000 one: 0.13 s and 150 MB, then
            # refused).
            most = {"max_pixels": str(max_pixels or _PROBE_MAX_PIXELS)}
            opened = {**_OPEN_OPTIONS, **most}
            container = av.open(io.BytesIO(data), mode="r", format=kind, options=opened)
            if _unsized(container):
                container.close()
                bounded = {**_SIZE_PROBE_OPTIONS, **most}
                container = av.open(io.BytesIO(data), mode="r", format=kind, options=bounded)
        except _DECODE_ERRORS as exc:
            raise VideoFileError(field, f"is not a readable video file ({exc})") from None
        return container

    container = reopen()
    if max_pixels is not None and _unsized(container):  # some decoders then say 0x0 (ffv1)
        container.close()
        raise LimitError(
            field,
            f"has no frame size within max_image_pixels = {max_pixels} (its first frame is "
            "past it, or its header gives none)",
        )
    try:
        header = read_header(container, fps, max_frames, field)
        check_header(header, max_pixels, max_seconds, field)
        check_decoding(header, max_decoded_pixels, field)
    except BaseException:
        container.close()
        raise
    return VideoFile(container, header, fps, field, max_decoded_pixels, planner, reopen)


def decode_video(data: bytes, **options: Any) -> TimedFrames | PlannedFrames:
    """`open_video(data, **options)`, then `VideoFile.decode`: the sampled frames
    `(T, H, W, 3)` uint8 with their times in seconds (planned, with a `planner`)."""
    return open_video(data, **options).decode()


def _unsized(container: av.container.InputContainer) -> bool:
    """Whether the first video stream's header gives no frame size."""
    video = container.streams.video
    codec = video[0].codec_context if video else None
    return codec is not None and (codec.width < 1 or codec.height < 1)
