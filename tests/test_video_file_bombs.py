"""Video files that cost far more to open than their size: limits checked before FFmpeg
does the work (`common.processing.video_file`, `common.processing.iso_boxes`)."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from common.processing import video_file
from common.processing.iso_boxes import MAX_BOXES, TooManyBoxes, declared_frames
from common.processing.limits import LimitError
from common.processing.video_file import MAX_STREAMS, VideoFileError, open_video
from tests.test_video_file import make_video


def declaring(data: bytes, count: int) -> bytes:
    """`data` (an mp4 of one frame) with its sample table declaring `count` frames of one
    constant size: a few bytes, whatever the count."""
    out = bytearray(data)
    at = out.find(b"stsz")
    size = struct.unpack_from(">I", out, at + 8)[0] or struct.unpack_from(">I", out, at + 16)[0]
    struct.pack_into(">II", out, at + 8, size, count)
    return bytes(out)


def test_an_mp4_declaring_more_frames_than_its_duration_allows_is_refused_unopened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FFmpeg indexes every frame an mp4 declares as it opens it: a 2.6 KB file declaring
    # 60 million frames (its duration 1 s) took 2.1 GB of the router, and was accepted.
    one = make_video("mp4", "mpeg4", frames=1, rate=1)
    assert declared_frames(one) == 1
    bomb = declaring(one, 60_000_000)
    assert declared_frames(bomb) == 60_000_000

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("FFmpeg was given the file")

    monkeypatch.setattr(video_file.av, "open", never)
    with pytest.raises(LimitError, match="declares 60000000 frames") as err:
        open_video(bomb, fps=2.0, max_frames=8, max_seconds=600.0, field="f")
    assert err.value.field == "f"


def test_fragment_runs_count_towards_the_declared_frames() -> None:
    def box(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", 8 + len(body)) + kind + body

    run = box(b"trun", struct.pack(">II", 0, 5_000_000))  # flags 0: no per-sample fields
    fragment = box(b"moof", box(b"mfhd", bytes(8)) + box(b"traf", run + run))
    assert declared_frames(box(b"ftyp", b"isom") + fragment * 3) == 30_000_000
    with pytest.raises(TooManyBoxes):
        declared_frames(box(b"free", b"") * (MAX_BOXES + 1))


def test_a_file_of_many_streams_opens_at_most_max_streams() -> None:
    # Each stream costs its decoder: 20 streams of 8192x8192 in a 4 MB file took 25 s and
    # 6 GB to open (with probing; see the next test). FFmpeg reads the first MAX_STREAMS.
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        streams = [container.add_stream("ffv1", rate=1) for _ in range(MAX_STREAMS + 4)]
        for stream in streams:
            stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for stream in streams:
            for packet in stream.encode(frame):
                container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    video = open_video(buf.getvalue(), fps=2.0, max_frames=8, field="f")
    try:
        assert len(video._container.streams) == MAX_STREAMS
    finally:
        video.close()


def test_files_are_opened_without_probing_their_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    # Probing decoded each stream's first frames before the frame size could be checked:
    # six h264 streams of 4096x4096 (300 KB) took 0.28 s of CPU to open, 0.03 s without.
    data = make_video(frames=2)
    opened: list[dict[str, str]] = []
    real_open = av.open

    def spy(*args: object, options: dict[str, str], **kwargs: object) -> object:
        opened.append(options)
        return real_open(*args, options=options, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(video_file.av, "open", spy)
    open_video(data, fps=2.0, max_frames=8).close()
    assert opened == [
        {"probesize": "32", "analyzeduration": "0", "fpsprobesize": "0", "max_streams": "16"}
    ]


def test_a_decoding_error_naming_the_field_is_not_wrapped_again() -> None:
    # "is not a decodable video (f: was still decoding when the request ended ...)"
    data = make_video(frames=8)
    with pytest.raises(VideoFileError) as err:
        open_video(data, fps=2.0, max_frames=8, field="f").decode(lambda: True)
    ended = "f: was still decoding when the request ended (client gone or deadline)"
    assert str(err.value) == ended


def test_a_file_whose_sampling_means_decoding_too_much_is_refused_from_the_header() -> None:
    # Two sample times 599 s apart in a file declaring 240 fps: every frame in between is
    # decoded (in order) to reach the second; at 4096x4096 that was 77 minutes of a router
    # thread, for a 4.7 MB file.
    from common.processing.video_file import MAX_DECODED_PIXELS

    data = make_video("matroska", "ffv1", frames=2, size=(1024, 1024), rate=240, pts=[0, 143_760])
    with pytest.raises(LimitError, match="decoding 143761 frames of 1024x1024") as err:
        open_video(data, fps=1 / 599, max_frames=8, field="f")
    assert err.value.field == "f"
    assert MAX_DECODED_PIXELS < 143_761 * 1024 * 1024
    video = open_video(data, fps=1 / 600, max_frames=8)  # one sample, at 0 s: one frame
    assert video.decode().times == (0.0,)


@pytest.mark.parametrize(("rotation", "left_column"), [(0, 255), (90, 0), (-90, 255), (180, 0)])
def test_a_rotated_stream_is_decoded_upright(rotation: int, left_column: int) -> None:
    # Phones store portrait video landscape with a display rotation: it reached the model
    # on its side, its grid's height and width swapped from what every player shows.
    from fractions import Fraction

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=2)
        stream.width, stream.height, stream.pix_fmt = 128, 64, "yuv420p"
        stream.set_display_rotation(rotation)
        pixels = np.zeros((64, 128, 3), np.uint8)
        pixels[:, :64] = 255  # the left half white
        for k in range(2):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts, frame.time_base = k, Fraction(1, 2)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    video = open_video(buf.getvalue(), fps=2.0, max_frames=8).decode()
    turned = rotation % 180 != 0
    assert video.frames.shape[1:3] == ((128, 64) if turned else (64, 128))
    # Turned counterclockwise by 90: the white left half is now the bottom half.
    first = video.frames[0]
    if turned:
        top, bottom = int(first[8, 32, 0]), int(first[-8, 32, 0])
        assert (top, bottom) == ((0, 255) if rotation == 90 else (255, 0)), (top, bottom)
    else:
        assert abs(int(first[32, 8, 0]) - left_column) <= 8
