"""Video files (issue 11): mp4 / webm / mkv decoded with PyAV, sampled at a rate, their
frames timed by the container; header limits before decoding; the router, client and CLI.

The files are made here with PyAV: tiny (16 frames of 64x64 at 8 fps unless a test needs
another shape), so each test encodes and decodes in milliseconds.
"""

from __future__ import annotations

import io
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import grpc
import numpy as np
import pytest
from PIL import Image

from cluster.cli import build_messages
from common.errors import FieldError
from common.models.tiny import default_checkpoint
from common.processing import video_file
from common.processing.limits import LimitError
from common.processing.processor import Processor
from common.processing.video import TimedFrames, temporal_timestamps
from common.processing.video_file import VideoFileError, container_format, decode_video, open_video
from common.processing.video_sampling import sample_times
from common.sampling import SamplingParams
from common.server.lifecycle import ServerLifecycle
from epd.client import GenerateError, build_request
from epd.v1 import router_service_pb2
from router.inputs import InputError
from router.server import RouterServicer
from router.settings import RouterSettings
from tests.test_router import FIRST, ckpt, cluster, workers  # noqa: F401  (fixtures)

# (container format, codec, file suffix): the kinds a client may send.
KINDS = [("mp4", "libx264", ".mp4"), ("webm", "libvpx-vp9", ".webm"), ("matroska", "ffv1", ".mkv")]


def make_video(
    fmt: str = "mp4",
    codec: str = "libx264",
    *,
    frames: int = 16,
    size: tuple[int, int] = (64, 64),
    rate: int = 8,
    pts: list[int] | None = None,
) -> bytes:
    """A video file whose frame k is a flat gray of value 15 k (pts in 1 / rate units)."""
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV build has no {codec} encoder")
    width, height = size
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for k in range(frames):
            pixels = np.full((height, width, 3), (15 * k) % 256, np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[k], Fraction(1, rate)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return make_video()


@pytest.fixture(scope="module")
def processor() -> Processor:
    return Processor.from_pretrained(default_checkpoint("tiny"))


def video_chat(video: Any, **extra: Any) -> list[dict[str, Any]]:
    part = {"type": "video", "video": video, **extra}
    return [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]


# ------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize(("fmt", "codec", "suffix"), KINDS)
def test_a_file_is_sampled_at_the_rate_with_the_containers_times(fmt, codec, suffix):
    data = make_video(fmt, codec)
    video = decode_video(data, fps=2.0, max_frames=768)
    assert video.frames.shape == (4, 64, 64, 3) and video.frames.dtype == np.uint8
    assert video.times == (0.0, 0.5, 1.0, 1.5) and video.fps == 2.0
    # Frames 0, 4, 8, 12 of the source (gray 15 k, within the codec's rounding).
    assert np.abs(video.frames[:, 32, 32, 0].astype(int) - [0, 60, 120, 180]).max() <= 3


def test_a_rate_above_the_sources_keeps_every_frame_once(mp4):
    video = decode_video(mp4, fps=30.0, max_frames=768)
    assert video.times == tuple(k / 8 for k in range(16))
    assert video.fps == 8.0  # the rate its frames come at, not the one asked for


@pytest.mark.parametrize("fps", [1.0, 2.0, 4.0, 8.0])
def test_a_rate_above_the_sources_drops_no_frame(processor, fps):
    # 8 s at 1 frame a second, sampled at 1 to 8: the same 8 frames each time, and the
    # processor keeps them all (it took a faster rate for a shorter video, and kept 4, 2,
    # then 1 temporal patch of them).
    slow = make_video(frames=8, rate=1)
    video = decode_video(slow, fps=fps, max_frames=768)
    assert video.times == tuple(float(k) for k in range(8))
    prompt = processor.process(video_chat(video, fps=fps))
    assert prompt.params.items[0].grid_thw == (4, 4, 4)


def test_decoding_stops_once_the_request_has_ended(mp4):
    # Frames decode in order up to the last sample time, on a thread nothing cancels: a
    # small file of many frames kept a router thread busy after its client had gone.
    asked = []

    def ended() -> bool:
        asked.append(True)
        return len(asked) > 3

    with pytest.raises(VideoFileError, match="still decoding when the request ended"):
        open_video(mp4, fps=2.0, max_frames=768).decode(ended)
    assert len(asked) == 4  # asked before each frame, stopped at the fourth
    assert len(decode_video(mp4, fps=2.0, max_frames=768).times) == 4  # as ever without


def test_the_frame_cap_spreads_the_frames_over_the_duration(mp4):
    assert sample_times(2.0, 2.0, 768) == (0.0, 0.5, 1.0, 1.5)
    assert sample_times(2.0, 8.0, 4) == (0.0, 0.5, 1.0, 1.5)  # 16 wanted, 4 uniform
    assert sample_times(0.1, 2.0, 768) == (0.0,)  # a short video keeps its first frame
    video = decode_video(mp4, fps=8.0, max_frames=4)
    assert video.times == (0.0, 0.5, 1.0, 1.5) and video.fps == 2.0
    assert len(decode_video(mp4, fps=8.0, max_frames=3).times) == 3


def test_variable_frame_times_come_from_the_container(processor):
    seconds = [0, 1, 2, 3, 5, 6, 7, 8]  # a gap between 3 s and 5 s
    data = make_video("matroska", "ffv1", frames=8, size=(32, 32), rate=1, pts=seconds)
    video = decode_video(data, fps=1.0, max_frames=768)
    assert video.times == tuple(float(s) for s in seconds)
    prompt = processor.process(video_chat(video))
    # Temporal patches of 2 frames: the mean of each pair's container times.
    assert prompt.frame_timestamps == ((0.5, 2.5, 5.5, 7.5),)
    assert "<5.5 seconds>" in prompt.prompt_text
    as_list = processor.process(video_chat(list(video.frames), fps=1.0))
    assert "<4.5 seconds>" in as_list.prompt_text  # index / fps, without the container's times


@pytest.mark.parametrize(("fmt", "codec", "suffix"), KINDS)
def test_the_prompt_of_a_file_is_the_prompt_of_its_frames(processor, fmt, codec, suffix):
    video = decode_video(make_video(fmt, codec), fps=2.0, max_frames=768)
    from_file = processor.process(video_chat(video))
    from_list = processor.process(video_chat(list(video.frames), fps=2.0))
    assert from_file.prompt_token_ids == from_list.prompt_token_ids
    assert from_file.prompt_text == from_list.prompt_text
    assert from_file.frame_timestamps == from_list.frame_timestamps == ((0.25, 1.25),)
    assert from_file.frame_timestamps[0] == tuple(temporal_timestamps(range(4), 2.0, 2))
    assert from_file.params.items[0].content_hash == from_list.params.items[0].content_hash
    assert all(
        np.array_equal(a, b)
        for a, b in zip(from_file.pixel_values, from_list.pixel_values, strict=True)
    )


def test_timed_frames_need_one_time_per_frame():
    with pytest.raises(ValueError, match="T times"):
        TimedFrames(np.zeros((2, 4, 4, 3), np.uint8), (0.0,), 2.0)


# ------------------------------------------------------------------- limits before work


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any) -> None:
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(video_file.VideoFile, "_decode", refuse)


def test_a_huge_frame_is_refused_from_the_header(no_decoding):
    data = make_video("matroska", "ffv1", frames=1, size=(4096, 4096))
    started = time.perf_counter()
    with pytest.raises(LimitError, match="max_image_pixels") as err:
        open_video(data, fps=2.0, max_frames=768, max_pixels=16384 * 32 * 32 - 1, field="f")
    assert err.value.field == "f" and "within max_image_pixels" in str(err.value)  # no size
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("fps", [5e-324, 1e-300, 1e-4, 2e4, float("nan"), float("inf"), 0.0])
def test_a_frame_rate_out_of_range_is_refused(processor, mp4, fps):
    # A subnormal rate overflowed the sampled frame count; 1e-300 wrote 300-digit
    # timestamps into the prompt.
    frames = [np.zeros((64, 64, 3), np.uint8)] * 4
    with pytest.raises(ValueError, match="fps must be within"):
        processor.process(video_chat(frames, fps=fps))
    with pytest.raises(FieldError, match="sample rate") as err:
        open_video(mp4, fps=fps, max_frames=768, field="f")
    assert err.value.field == "f"


def test_a_file_declaring_a_rate_past_any_camera_is_refused_from_the_header(no_decoding):
    # Frames are decoded in order up to the last sample: a 30 s file declaring 1000 fps had
    # the router decode ~20,000 frames to keep a handful.
    data = make_video("matroska", "ffv1", frames=3, size=(32, 32), rate=1000)
    with pytest.raises(VideoFileError, match="1000 frames per second") as err:
        open_video(data, fps=2.0, max_frames=768, field="f")
    assert err.value.field == "f"
    assert open_video(
        make_video("matroska", "ffv1", frames=3, size=(32, 32), rate=240), fps=2.0, max_frames=768
    )


def test_a_too_long_video_is_refused_from_the_header(no_decoding):
    # Two frames, 2000 s apart: a tiny file whose header says 2001 s.
    data = make_video("matroska", "ffv1", frames=2, size=(32, 32), rate=1, pts=[0, 2000])
    with pytest.raises(LimitError, match="max_video_seconds"):
        open_video(data, fps=2.0, max_frames=768, max_seconds=600.0)
    with pytest.raises(LimitError, match="max_video_file_bytes"):
        open_video(data, fps=2.0, max_frames=768, max_bytes=len(data) - 1)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "is empty"),
        (b"GIF89a not a video", "is not an mp4, mov, webm or mkv file"),
        (b"\x00\x00\x00\x18ftypmp42" + bytes(64), "is not a"),
        (b"\x1a\x45\xdf\xa3" + b"\xff" * 64, "is not a"),
    ],
)
def test_malformed_files_are_refused_naming_the_field(data, message):
    with pytest.raises(VideoFileError, match=message) as err:
        decode_video(data, fps=2.0, max_frames=8, field="messages[0].content[0].video.file")
    assert err.value.field == "messages[0].content[0].video.file"
    assert isinstance(err.value, FieldError)


def test_a_stream_in_an_unknown_codec_is_refused_naming_the_field(mp4):
    """Found by mutating files: a sample entry FFmpeg does not know leaves the stream
    without a codec context (an AttributeError, an internal error, before)."""
    unknown = mp4.replace(b"avc1", b"zzzz")
    with pytest.raises(VideoFileError, match="codec this server cannot decode") as err:
        open_video(unknown, fps=2.0, max_frames=8, field="messages[0].content[0].video.file")
    assert err.value.field == "messages[0].content[0].video.file"


def test_a_truncated_file_is_refused_or_gives_its_complete_frames(mp4):
    try:
        video = decode_video(mp4[: len(mp4) // 2], fps=2.0, max_frames=8)
    except VideoFileError:
        return
    assert 1 <= len(video.times) <= 4


def test_the_container_kind_comes_from_the_magic_bytes(mp4):
    assert container_format(mp4, "f") == "mov"
    assert container_format(make_video("webm", "libvpx-vp9"), "f") == "matroska"
    with pytest.raises(VideoFileError):
        container_format(b"#EXTM3U\nhttp://example.com/a.ts\n", "f")  # no playlists


# ------------------------------------------------------------------------------ router


def file_request(data: bytes, fps: float = 0.0) -> router_service_pb2.GenerateRequest:
    request = router_service_pb2.GenerateRequest(request_id="r")
    video = router_service_pb2.VideoInput(file=data, fps=fps)
    request.messages.add(role="user", content=[router_service_pb2.ContentPart(video=video)])
    return request


def prepare(processor: Processor, **settings: Any) -> Any:
    return RouterServicer(processor, None, ServerLifecycle(), RouterSettings(**settings))._prepare  # type: ignore[arg-type]


def test_the_router_samples_a_file_at_its_default_rate(processor, mp4):
    _, prompt = prepare(processor)(file_request(mp4))
    assert prompt.grid_thw[0][0] == 2  # 4 frames at 2 fps, 2 per temporal patch
    assert prompt.frame_timestamps == ((0.25, 1.25),)
    _, faster = prepare(processor, video_file_fps=8.0)(file_request(mp4, fps=4.0))
    assert faster.grid_thw[0][0] == 2  # 8 frames at 4 fps; the processor keeps 2 per second


@pytest.mark.parametrize(
    ("settings", "data", "limit"),
    [
        ({"max_image_pixels": 32 * 32}, None, "max_image_pixels"),
        ({"max_video_seconds": 1.0}, None, "max_video_seconds"),
        ({"max_video_file_bytes": 100}, None, "max_video_file_bytes"),
        ({"max_media_bytes": 3 * 64 * 64 * 4}, None, "max_media_bytes"),  # 4 frames to come
    ],
)
def test_router_limits_refuse_a_file_before_decoding(
    processor, mp4, no_decoding, settings, data, limit
):
    with pytest.raises(InputError, match=limit) as err:
        prepare(processor, **settings)(file_request(data or mp4))
    assert err.value.field == "messages[0].content[0].video.file"


def test_frames_and_a_file_together_are_refused(processor, mp4):
    request = file_request(mp4)
    request.messages[0].content[0].video.frames.append(b"x")
    with pytest.raises(InputError, match="exactly one of frames and file") as err:
        prepare(processor)(request)
    assert err.value.field == "messages[0].content[0].video"


async def test_a_malformed_file_is_invalid_argument_through_the_router(cluster, workers, mp4):  # noqa: F811
    enc, pre, dec = workers
    for bad in (b"not a video", mp4[:40]):
        with pytest.raises(GenerateError) as err:
            await cluster.client.generate_text(video_chat(bad))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details.startswith("messages[0].content[0].video.file")
    assert enc.requests == [] and pre.requests == [] and dec.requests == []
    result = await cluster.client.generate_text(video_chat(mp4), SamplingParams(max_tokens=2))
    assert result.token_ids == [FIRST, 101]
    (item,) = enc.requests[0].items
    assert item.grid_thw[0] == 2


async def test_a_video_still_decoding_at_the_deadline_is_deadline_exceeded(cluster, workers, mp4):  # noqa: F811
    from common.server.auth import ANONYMOUS
    from router.calls import RouterError

    chunks = cluster.router.servicer.generate(build_request(video_chat(mp4)), ANONYMOUS, 0.0)
    with pytest.raises(RouterError) as err:
        await anext(chunks)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "still decoding when the request ended" in str(err.value)
    enc, pre, dec = workers
    assert enc.requests == [] and pre.requests == [] and dec.requests == []


# ------------------------------------------------------------------------ client and CLI


@pytest.fixture
def frames_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "clip"
    folder.mkdir()
    for k in (1, 0, 2):
        Image.fromarray(np.full((16, 16, 3), k * 40, np.uint8)).save(folder / f"{k:03d}.png")
    return folder


def sent_video(video: Any, **extra: Any) -> router_service_pb2.VideoInput:
    request = build_request(video_chat(video, **extra))
    return request.messages[0].content[0].video


def test_the_client_sends_a_file_path_as_the_file(tmp_path, mp4):
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4)
    for source in (path, str(path), mp4):
        sent = sent_video(source)
        assert sent.file == mp4 and not sent.frames and sent.fps == 0.0
    assert sent_video(path, fps=4).fps == 4.0
    with pytest.raises(ValueError, match="no such file or folder"):
        build_request(video_chat(str(tmp_path / "missing.mp4")))


def test_the_client_sends_a_folder_and_a_list_as_frames(frames_dir):
    files = sorted(frames_dir.iterdir())
    for source in (str(frames_dir), frames_dir, files, [str(f) for f in files]):
        sent = sent_video(source, fps=2.0)
        assert not sent.file and list(sent.frames) == [f.read_bytes() for f in files]
    arrays = sent_video([np.zeros((8, 8, 3), np.uint8)] * 2, fps=2.0)
    assert len(arrays.frames) == 2
    with pytest.raises(ValueError, match="needs a positive fps"):
        build_request(video_chat(str(frames_dir)))


def test_the_cli_sends_a_video_file_with_its_sample_rate(tmp_path, mp4, frames_dir):
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4)
    messages = build_messages("what happens?", [], [path, frames_dir], fps=2.0)
    clip, folder, _ = messages[0]["content"]
    assert clip == {"type": "video", "video": mp4, "fps": 2.0}
    assert len(folder["video"]) == 3
    assert sent_video(clip["video"], fps=clip["fps"]).file == mp4
    # Without --fps a file goes without a rate (the router's `video_file_fps` applies: the
    # CLI's 2.0 hid it), and a folder at 2 frames a second.
    clip, folder, _ = build_messages("what happens?", [], [path, frames_dir])[0]["content"]
    assert "fps" not in clip and folder["fps"] == 2.0
