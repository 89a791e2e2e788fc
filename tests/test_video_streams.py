"""A video file's other streams (audio, attachments, data tracks) as its video is read:
they cost no thread time past the request's end, and their packets are never taken for the
video's (`common.processing.video_file.VideoFile._packets`)."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest

from common.processing.video_file import open_video
from tests.test_video_planned import assert_same, both, planner_of
from tests.test_video_planned import processor as processor  # a fixture
from tests.video_helpers import mux_frames


def test_ended_is_asked_as_packets_are_read_not_only_frames(processor):
    # 20,000 tiny audio packets among 8 frames: reading them asks whether the request ended,
    # planned and whole alike (it was asked per frame: seconds of a thread for a file of
    # millions, the client gone).
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        video = container.add_stream("libx264", rate=8)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        audio = container.add_stream("pcm_u8", rate=8000)
        packets = []
        for k in range(20_000):
            packet = av.Packet(b"\x80")
            packet.stream, packet.time_base = audio, Fraction(1, 40_000)  # to 0.5 s
            packet.pts = packet.dts = k
            packets.append(packet)
        frames = [np.full((64, 64, 3), 20 * k, np.uint8) for k in range(8)]
        mux_frames(container, video, frames, Fraction(1, 8))
        for packet in packets:
            container.mux(packet)
    for planner in (None, planner_of(processor)):
        asked: list[int] = []

        def ended(asked: list[int] = asked) -> bool:
            asked.append(1)
            return False

        open_video(buf.getvalue(), fps=2.0, max_frames=768, planner=planner).decode(ended)
        assert len(asked) >= 19, len(asked)  # 20,000 packets: every 1024; 5 frames


@pytest.mark.parametrize("attached", [False, True])
def test_a_video_after_other_streams_keeps_its_last_frames(processor, attached):
    # Its decoder's flush packet names stream 0 (PyAV's, at the end): read by that index, a
    # video after an audio stream lost the B-frames its decoder held at the end, and an
    # attachment's flush packet was decoded, an AttributeError (ownfixA review, s43).
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        audio = container.add_stream("pcm_s16le", rate=8000)
        video = container.add_stream("libx264", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        video.options = {"bframes": "3"}
        if attached:
            container.add_attachment("font.ttf", "application/x-truetype-font", b"\0" * 100)
        rng = np.random.default_rng(0)
        base = rng.integers(0, 256, (48, 64, 3), np.uint8)
        mux_frames(
            container, video, [np.roll(base, 3 * k, axis=1) for k in range(24)], Fraction(1, 8)
        )
        sound = av.AudioFrame.from_ndarray(
            np.zeros((1, 8800), np.int16), format="s16", layout="mono"
        )
        sound.sample_rate, sound.pts, sound.time_base = 8000, 0, Fraction(1, 8000)
        for packet in [*audio.encode(sound), *audio.encode()]:  # 0.1 s past the video
            container.mux(packet)
    whole, planned = both(processor, buf.getvalue(), fps=8.0, max_frames=768)
    assert len(whole.times) == 24 and whole.times[-1] == pytest.approx(23 / 8)
    assert_same(processor, whole, planned)


@pytest.mark.parametrize("fmt", ["mov", "mp4"])
def test_a_data_tracks_end_is_not_decoded(processor, fmt):
    # A timecode track (a data stream) beside the video, which is stream 0, and a last frame
    # lasting 2 s (the sampling is not done at the video's end): the data stream's flush
    # packet, naming stream 0, was decoded as the video's, an AttributeError naming no field
    # (ownfixA F2, s43).
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        video = container.add_stream("libx264", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        video.options = {"bframes": "0"}
        video.metadata["timecode"] = "01:00:00:00"
        packets = []
        for k in range(24):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 9 * k, np.uint8), "rgb24")
            frame.pts, frame.time_base = k, Fraction(1, 8)
            packets += video.encode(frame)
        packets += video.encode()
        packets[-1].duration = int(2.0 / float(packets[-1].time_base))
        for packet in packets:
            container.mux(packet)
    with av.open(io.BytesIO(buf.getvalue())) as opened:
        kinds = [s.type for s in opened.streams]
    if kinds != ["video", "data"]:
        pytest.skip(f"this FFmpeg writes no timecode track here: {kinds}")
    whole, planned = both(processor, buf.getvalue(), fps=2.0, max_frames=768)
    assert whole.times == (0.0, 0.5, 1.0, 1.5, 2.0, 2.5)  # (none near 3 s and after)
    assert_same(processor, whole, planned)
