"""Video files that cost far more to open than their size: limits checked before FFmpeg
does the work (`common.processing.video_file`, `common.processing.iso_boxes`)."""

from __future__ import annotations

import io
import struct
from typing import Any

import av
import numpy as np
import pytest

from common.errors import FieldError
from common.processing import video_file
from common.processing.iso_boxes import MAX_BOXES, check_mp4, declared
from common.processing.limits import LimitError
from common.processing.video_file import MAX_STREAMS, VideoFileError, open_video
from tests.test_video_file import make_video
from tests.test_video_file import no_decoding as no_decoding  # a fixture
from tests.video_helpers import mux_frames


def declaring(data: bytes, count: int) -> bytes:
    """`data` (an mp4 of one frame) with its sample table declaring `count` frames of one
    constant size: a few bytes, whatever the count."""
    out = bytearray(data)
    at = out.find(b"stsz")
    size = struct.unpack_from(">I", out, at + 8)[0] or struct.unpack_from(">I", out, at + 16)[0]
    struct.pack_into(">II", out, at + 8, size, count)
    return bytes(out)


def box(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", 8 + len(body)) + kind + body


def test_an_mp4_declaring_more_samples_than_its_bytes_hold_is_refused_unopened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FFmpeg indexes every sample an mp4 declares as it opens it: a 2.6 KB file declaring
    # 60 million frames (its duration 1 s) took 2.1 GB of the router, and was accepted.
    # Then, past a first fix: the same bomb in a moov box whose size runs past the file's
    # end (FFmpeg cuts it to fit; the walk stopped), in an audio track, or compressed.
    one = make_video("mp4", "mpeg4", frames=1, rate=1)
    assert declared(one).video_frames == 1
    bomb = declaring(one, 60_000_000)
    moov = bomb.find(b"moov") - 4
    past_end = bytearray(bomb)
    struct.pack_into(">I", past_end, moov, struct.unpack_from(">I", bomb, moov)[0] + 1000)
    audio = bytearray(bomb)
    at = audio.find(b"vide")
    audio[at : at + 4] = b"soun"
    compressed = one[:moov] + box(b"moov", box(b"cmov", bytes(32)))

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("FFmpeg was given the file")

    monkeypatch.setattr(video_file.av, "open", never)
    for data, says in (
        (bomb, "declares 60000000 samples"),
        (bytes(past_end), "declares 60000000 samples"),
        (bytes(audio), "declares 60000000 samples"),
        (compressed, "compressed movie header"),
    ):
        with pytest.raises(FieldError, match=says) as err:
            open_video(data, fps=2.0, max_frames=8, max_seconds=600.0, field="f")
        assert err.value.field == "f"


def test_an_mp4_whose_video_declares_more_than_max_video_seconds_is_refused() -> None:
    # Within its bytes (one byte a sample) but past 600 s at 240 frames a second.
    def table(kind: bytes, samples: int) -> bytes:
        hdlr = box(b"hdlr", bytes(8) + kind + bytes(12))
        stsz = box(b"stsz", struct.pack(">III", 0, 1, samples))
        return box(b"trak", box(b"mdia", hdlr + box(b"minf", box(b"stbl", stsz))))

    data = (
        box(b"ftyp", b"isom") + box(b"moov", table(b"vide", 300_000)) + box(b"mdat", bytes(310_000))
    )
    with pytest.raises(LimitError, match="declares 300000 frames; max_video_seconds = 600"):
        check_mp4(data, 600.0, 240.0, 1.5, "f")
    check_mp4(data, 1000.0, 240.0, 1.5, "f")  # longer allowed: fine
    audio = (
        box(b"ftyp", b"isom") + box(b"moov", table(b"soun", 300_000)) + box(b"mdat", bytes(310_000))
    )
    check_mp4(audio, 600.0, 240.0, 1.5, "f")  # sound samples: bounded by the bytes only


def test_fragment_runs_count_and_too_many_boxes_are_refused() -> None:
    run = box(b"trun", struct.pack(">II", 0, 5_000_000))  # flags 0: no per-sample fields
    fragment = box(b"moof", box(b"mfhd", bytes(8)) + box(b"traf", run + run))
    data = box(b"ftyp", b"isom") + fragment * 3
    assert declared(data).video_frames == 30_000_000
    with pytest.raises(FieldError, match="declares 30000000 samples"):
        check_mp4(data, None, 240.0, 1.5, "f")
    with pytest.raises(FieldError, match="boxes"):
        check_mp4(box(b"free", b"") * (MAX_BOXES + 1), None, 240.0, 1.5, "f")


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
    open_video(data, fps=2.0, max_frames=8, max_pixels=1 << 20).close()
    unlimited, limited = opened
    assert unlimited["probesize"] == "32" and unlimited["analyzeduration"] == "0"
    assert unlimited["fpsprobesize"] == "0" and unlimited["max_streams"] == "16"
    # Opening still decodes the first stream's first frame: the decoders refuse one past
    # the pixel limit (an 8000x8000 h264 frame cost 0.13 s and 150 MB before its refusal;
    # video review), or past the probe's own limit where the caller sets none.
    assert limited["max_pixels"] == str(1 << 20)
    assert unlimited["max_pixels"] == str(video_file._PROBE_MAX_PIXELS)


def test_a_decoding_error_naming_the_field_is_not_wrapped_again() -> None:
    # "is not a decodable video (f: was still decoding when the request ended ...)"
    data = make_video(frames=8)
    with pytest.raises(VideoFileError) as err:
        open_video(data, fps=2.0, max_frames=8, field="f").decode(lambda: True)
    ended = "f: was still decoding when the request ended (client gone or deadline)"
    assert str(err.value) == ended


def test_a_file_whose_sampling_means_decoding_too_much_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two sample times 599 s apart in a file declaring 240 fps: every frame in between is
    # decoded (in order) to reach the second; at 4096x4096 that was 77 minutes of a router
    # thread, for a 4.7 MB file. Refused from the header where it states a rate.
    data = make_video("matroska", "ffv1", frames=2, size=(1024, 1024), rate=240, pts=[0, 143_760])
    limit = 10**11
    with pytest.raises(LimitError, match="decoding 143761 frames of 1024x1024") as err:
        open_video(data, fps=1 / 599, max_frames=8, max_decoded_pixels=limit, field="f")
    assert err.value.field == "f" and limit < 143_761 * 1024 * 1024
    video = open_video(data, fps=1 / 600, max_frames=8, max_decoded_pixels=limit)
    assert video.decode().times == (0.0,)  # one sample, at 0 s: one frame
    # A header stating no rate (a Matroska track without DefaultDuration) was taken for
    # 240 fps and refused whatever its real rate: now the pixels are counted as decoded.
    monkeypatch.setattr(video_file, "check_decoding", lambda *args: None)
    many = make_video(frames=16, size=(64, 64), rate=8)
    with pytest.raises(LimitError, match="passed max_video_decoded_pixels = 12288") as err:
        open_video(many, fps=8.0, max_frames=16, max_decoded_pixels=3 * 64 * 64).decode()
    assert "4 frames of 64x64" in str(err.value)


@pytest.mark.parametrize(
    ("turn", "shape", "quadrants"),
    [
        ({}, (64, 128), [[1, 0], [0, 0]]),
        ({"rotation": -90}, (128, 64), [[0, 1], [0, 0]]),  # a phone's portrait video
        ({"rotation": 90}, (128, 64), [[0, 0], [1, 0]]),
        ({"rotation": 180}, (64, 128), [[0, 0], [0, 1]]),
        ({"hflip": True}, (64, 128), [[0, 1], [0, 0]]),  # was turned upside down
        ({"vflip": True}, (64, 128), [[0, 0], [1, 0]]),  # was left as stored
        ({"matrix": [0] * 9}, (64, 128), [[1, 0], [0, 0]]),  # degenerate: was turned 90
        # A quarter turn and a flip: a transpose, as FFmpeg's autorotate (was 180 off).
        ({"rotation": 90, "hflip": True}, (128, 64), [[0, 0], [0, 1]]),
        ({"rotation": 90, "vflip": True}, (128, 64), [[1, 0], [0, 0]]),
        ({"rotation": -90, "hflip": True}, (128, 64), [[1, 0], [0, 0]]),
        ({"rotation": -90, "vflip": True}, (128, 64), [[0, 0], [0, 1]]),
    ],
)
def test_a_stream_is_decoded_as_its_display_matrix_shows_it(
    turn: dict[str, Any], shape: tuple[int, int], quadrants: list[list[int]]
) -> None:
    # Phones store portrait video landscape with a display rotation: it reached the model
    # on its side, its grid's height and width swapped from what every player shows.
    from fractions import Fraction

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=2)
        stream.width, stream.height, stream.pix_fmt = 128, 64, "yuv420p"
        if "matrix" in turn:
            stream.set_display_matrix(turn["matrix"])
        elif turn:
            stream.set_display_rotation(
                turn.get("rotation", 0), **{k: v for k, v in turn.items() if k != "rotation"}
            )
        pixels = np.zeros((64, 128, 3), np.uint8)
        pixels[:32, :64] = 255  # the top-left quadrant white
        mux_frames(container, stream, [pixels] * 2, Fraction(1, 2))
    first = open_video(buf.getvalue(), fps=2.0, max_frames=8).decode().frames[0]
    assert first.shape[:2] == shape
    h, w = shape
    seen = [
        [int(first[h // 4 + i * h // 2, w // 4 + j * w // 2, 0] > 128) for j in (0, 1)]
        for i in (0, 1)
    ]
    assert seen == quadrants


def test_sample_tables_count_wherever_ffmpeg_reads_them() -> None:
    # A review bypassed the structural walk: FFmpeg reads a table wherever it meets one,
    # parses a moov renamed hoov or free, reads fields past a box too short for them, and
    # sums every track (16 tracks of a file's bytes each: 46 s and 2.4 GB to open).
    stsz = box(b"stsz", struct.pack(">III", 0, 1, 60_000_000))
    short = box(b"stsz", b"") + struct.pack(">III", 0, 1, 60_000_000)  # fields past its end
    pad = box(b"mdat", bytes(4096))
    for header in (
        box(b"moov", box(b"udta", stsz)),  # not in stbl
        box(b"hoov", box(b"trak", stsz)),  # a renamed moov
        box(b"moov", box(b"trak", short)),
        box(
            b"moov",
            b"".join(box(b"trak", box(b"stsz", struct.pack(">III", 0, 1, 3000))) for _ in range(2)),
        ),
    ):
        data = box(b"ftyp", b"isom") + header + pad
        with pytest.raises(FieldError, match="samples, more than its"):
            check_mp4(data, None, 240.0, 1.5, "f")
    # Uncompressed sound is indexed by chunk: one chunk of more samples than the file has
    # bytes (a review's 6.8 KB file took 6.1 GB), and edit lists copying the index.
    chunks = box(b"stsc", struct.pack(">IIIII", 0, 1, 1, 2**31 - 1024, 1)) + box(
        b"stco", struct.pack(">II", 0, 16) + bytes(64)
    )
    with pytest.raises(FieldError, match=f"declares {2**31 - 1024} samples"):
        check_mp4(box(b"ftyp", b"isom") + box(b"moov", chunks) + pad, None, 240.0, 1.5, "f")
    edits = box(b"elst", struct.pack(">II", 0, 400) + bytes(400 * 12))
    with pytest.raises(FieldError, match="more than 64 edit-list entries"):
        check_mp4(box(b"ftyp", b"isom") + box(b"moov", edits) + pad, None, 240.0, 1.5, "f")
    # Text is not a table: a title saying "Elephant trunk", "the stsz box" or "stco remix"
    # refused the file (a review of the scan).
    title = box(b"udta", box(b"\xa9nam", b"Elephant trunk, the stsz box (stco remix) trak"))
    check_mp4(box(b"ftyp", b"isom") + box(b"moov", title) + pad, None, 240.0, 1.5, "f")
    value = box(b"data", struct.pack(">II", 1, 0) + b"truncated take")  # an iTunes title
    tagged = box(b"udta", box(b"meta", bytes(4) + box(b"ilst", box(b"\xa9nam", value))))
    check_mp4(box(b"ftyp", b"isom") + box(b"moov", tagged) + pad, None, 240.0, 1.5, "f")
    # Tables inside mdat are data, not read: a video's bytes may spell anything.
    check_mp4(box(b"ftyp", b"isom") + box(b"mdat", stsz * 4), None, 240.0, 1.5, "f")


def test_a_huge_h264_frame_is_refused_with_its_size(no_decoding: None) -> None:
    # The decoders refuse a frame past the limit as the file opens (an 8000x8000 h264 one
    # cost 0.13 s and 150 MB before its refusal); h264's still reports the size.
    data = make_video("mp4", "libx264", frames=1, size=(2048, 2048))
    with pytest.raises(LimitError, match="max_image_pixels") as err:
        open_video(data, fps=2.0, max_frames=8, max_pixels=1 << 20, field="f")
    assert err.value.field == "f" and "2048x2048" in str(err.value)
