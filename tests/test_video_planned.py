"""A video file decoded planned (`common.processing.frame_store.PlannedStore`): only the
frames the processor samples, resized as they decode, make the same prompt and patch codes
as every kept frame decoded whole and processed after; and the router counts what that
holds, so the default limits take minutes of HD video (s42 media review M1: a 130 s 720p
file was refused, every sampled frame held at full size)."""

from __future__ import annotations

import dataclasses
import functools
import io
from fractions import Fraction
from typing import Any

import av
import numpy as np
import pytest

from common.models.tiny import default_checkpoint
from common.processing.frame_store import PlannedStore
from common.processing.limits import LimitError, MediaBudget
from common.processing.processor import Processor
from common.processing.video import PlannedFrames, TimedFrames, plan_video, preprocess_video
from common.processing.video_file import VideoHeader, open_video
from router.media_cost import MediaCost
from router.settings import RouterSettings
from tests.test_video_file import KINDS, make_video, video_chat
from tests.video_helpers import mux_frames


@pytest.fixture(scope="module")
def processor() -> Processor:
    return Processor.from_pretrained(default_checkpoint("tiny"))


def planner_of(processor: Processor) -> Any:
    return functools.partial(plan_video, settings=processor.settings)


def both(processor: Processor, data: bytes, **options: Any) -> tuple[Any, Any]:
    """The file decoded whole and planned, with the same options."""
    whole = open_video(data, **options).decode()
    planned = open_video(data, planner=planner_of(processor), **options).decode()
    assert isinstance(whole, TimedFrames) and isinstance(planned, PlannedFrames)
    return whole, planned


def assert_same(processor: Processor, whole: TimedFrames, planned: PlannedFrames) -> None:
    a = preprocess_video(whole, 0.0, processor.settings)
    b = preprocess_video(planned, 0.0, processor.settings)
    assert a.grid_thw == b.grid_thw and a.timestamps == b.timestamps
    assert np.array_equal(a.patches, b.patches)
    x, y = processor.process(video_chat(whole)), processor.process(video_chat(planned))
    assert x.prompt_token_ids == y.prompt_token_ids
    assert x.params.items[0].content_hash == y.params.items[0].content_hash


def noisy_video(frames: int, size: tuple[int, int], rate: int) -> bytes:
    """Random frames in a lossless codec: resizing differences would show."""
    width, height = size
    rng = np.random.default_rng(3)
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        pixels = [rng.integers(0, 256, (height, width, 3), np.uint8) for _ in range(frames)]
        mux_frames(container, stream, pixels, Fraction(1, rate))
    return buf.getvalue()


@pytest.mark.parametrize(("fmt", "codec", "suffix"), KINDS)
def test_a_planned_file_makes_the_codes_of_its_whole_frames(processor, fmt, codec, suffix):
    whole, planned = both(processor, make_video(fmt, codec), fps=2.0, max_frames=768)
    assert planned.times == whole.times and planned.fps == whole.fps
    assert_same(processor, whole, planned)


@pytest.mark.parametrize(
    ("fps", "max_frames"),
    [(2.0, 768), (8.0, 768), (8.0, 5), (0.5, 768)],  # sampled, every frame, spread, sparse
)
def test_planned_noise_frames_resize_to_the_same_bytes(processor, fps, max_frames):
    data = noisy_video(24, (97, 61), 8)  # odd sizes: resized, not only copied
    whole, planned = both(processor, data, fps=fps, max_frames=max_frames)
    assert planned.frames.shape[0] == len(planned.plan.indices) <= len(whole.times)
    assert_same(processor, whole, planned)


def test_a_source_slower_than_the_rate_is_planned_for_what_it_keeps_and_decoded_once(processor):
    # 8 frames at 1 a second sampled at 4: 32 sample times, 8 kept. Planned for 32, it was
    # decoded a second time, planned for 8 (ownfixA review, s42); its packets' times say 8.
    slow = make_video(frames=8, rate=1)
    whole, planned = both(processor, slow, fps=4.0, max_frames=768)
    assert len(planned.times) == 8 and planned.times == whole.times
    assert_same(processor, whole, planned)
    opened = open_video(slow, fps=4.0, max_frames=768, planner=planner_of(processor))
    opened.decode()
    assert opened._decoded == 8


def test_a_second_pass_is_within_the_decoding_limit_as_a_first(processor, monkeypatch):
    # Where the decoder keeps another count than the packets said (a codec's cut streams:
    # ownfixC), the file is planned for that and decoded again, each pass within the limit:
    # a wrong count costs time, never a refusal decoding whole would not make.
    from common.processing import video_file

    data = make_video(frames=16, rate=8)  # 64 x 64
    monkeypatch.setattr(video_file, "kept_from_packets", lambda *args: 3)  # says 3, keeps 4
    once = 13 * 64 * 64  # what one pass decodes, to 1.5 s
    planned = open_video(
        data, fps=2.0, max_frames=768, planner=planner_of(processor), max_decoded_pixels=once
    )
    got = planned.decode()
    assert len(got.times) == 4 and planned._decoded == 2 * 13
    whole = open_video(data, fps=2.0, max_frames=768, max_decoded_pixels=once).decode()
    assert isinstance(whole, TimedFrames) and isinstance(got, PlannedFrames)
    assert_same(processor, whole, got)


def test_variable_frame_times_are_kept_planned(processor):
    seconds = [0, 1, 2, 3, 5, 6, 7, 8]  # a gap between 3 s and 5 s
    data = make_video("matroska", "ffv1", frames=8, size=(32, 32), rate=1, pts=seconds)
    whole, planned = both(processor, data, fps=1.0, max_frames=768)
    assert planned.times == tuple(float(s) for s in seconds)
    assert_same(processor, whole, planned)


def test_the_store_plans_from_the_frames_as_kept_not_the_header(processor):
    # A turned file's frames come upright (`upright_frame`): tall where its header says
    # wide. The store plans from the frames it is given, as the processor would.
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (7, 90, 38, 3), np.uint8)
    times = tuple(k / 2 for k in range(7))
    planner = functools.partial(plan_video, settings=processor.settings)
    store = PlannedStore(7, 2.0, planner, "video")
    for k, pixels in enumerate(frames):
        store.keep(k, pixels)
    planned = store.result(times, 2.0)
    assert planned is not None and planned.source_size == (38, 90)
    assert_same(processor, TimedFrames(frames, times, 2.0), planned)
    assert PlannedStore(8, 2.0, planner, "video").result(times, 2.0) is None  # planned for 8


def test_planned_frames_made_with_other_settings_are_refused(processor):
    _, planned = both(processor, make_video(), fps=2.0, max_frames=768)
    other = dataclasses.replace(processor.settings, video_max_pixels=4 * 32 * 32)
    with pytest.raises(ValueError, match="other processor settings"):
        preprocess_video(planned, 0.0, other)


def counted(seconds: float, size: tuple[int, int]) -> bool:
    """Whether the router's default limits take a file of `seconds` at `size`, 30 fps,
    sampled at 2 (from its header, as a request is counted before decoding)."""
    from common.models.qwen3_vl.preprocessor import ProcessorSettings

    limits = RouterSettings().input_limits(262144)
    cost = MediaCost(ProcessorSettings(), limits, MediaBudget(limits))
    times = tuple(k / 2 for k in range(int(seconds * 2)))
    header = VideoHeader(*size, seconds, 30.0, times, "yuv420p")
    try:
        cost.video_file(header, 2.0, "video")
    except LimitError:
        return False
    return True


def test_the_default_limits_take_minutes_of_hd_video():
    # Counted whole, 1080p passed max_media_bytes from ~35 s and 720p from ~70 s; the 600 s
    # of max_video_seconds were out of reach at any usual size (s42 media review M1).
    assert counted(130.0, (1280, 720))
    assert counted(300.0, (1920, 1080))
    assert counted(383.0, (640, 360))  # 766 sample times: just under max_video_frames


def test_a_file_keeping_fewer_frames_than_its_header_says_fits_its_reservation():
    # Planned for the frames it keeps (fewer and larger), a 599 s 4K file with 3 frames held
    # 1.47x what its header's plan of 599 reserved (ownfixA review, s42).
    from common.models.qwen3_vl.preprocessor import ProcessorSettings
    from common.processing.limits import InputLimits
    from common.processing.video_sampling import kept_rate, sample_times

    s = ProcessorSettings()
    for width, height in ((3840, 2160), (1280, 720), (720, 1280), (320, 240)):
        for seconds, fps in ((599.0, 1.0), (61.0, 2.0), (10.0, 8.0), (2.2, 2.0)):
            times = sample_times(seconds, fps, 768)
            cost = MediaCost(s, InputLimits(), MediaBudget(InputLimits()))
            cost.video_file(VideoHeader(width, height, seconds, 30.0, times, "yuv420p"), fps, "v")
            for kept in {1, 2, 3, 4, 5, 7, len(times) // 3, len(times) // 2, len(times)} - {0}:
                plan = plan_video(kept, kept_rate(seconds, fps, kept), width, height, s)
                h, w = plan.size
                steps = len(plan.padded) // s.temporal_patch_size
                held = (len(plan.indices) + steps * s.temporal_patch_size) * h * w * 3
                assert held <= cost.budget.used, (width, height, seconds, fps, kept)


@pytest.mark.parametrize("cut", [0.5, 0.8, 0.95])
def test_a_truncated_file_planned_ends_as_decoded_whole(processor, cut):
    # Its packets read to the end (where a corrupt tail may stop the demuxer) only to
    # count them: planned, it is refused or kept as decoding it whole refuses or keeps it.
    data = noisy_video(24, (97, 61), 8)
    cut_data = data[: int(len(data) * cut)]

    def outcome(planner: Any) -> Any:
        try:
            return open_video(cut_data, fps=4.0, max_frames=768, planner=planner).decode()
        except Exception as exc:
            return type(exc)

    whole, planned = outcome(None), outcome(planner_of(processor))
    if isinstance(whole, TimedFrames):
        assert isinstance(planned, PlannedFrames)
        assert_same(processor, whole, planned)
    else:
        assert planned is whole


def test_a_stream_cut_before_its_first_keyframe_is_decoded_once(processor, tmp_path):
    # A recording cut mid-GOP starts with frames the decoder drops: counted from the first
    # keyframe on, or it was planned for frames it never kept and decoded twice (ownfixB).
    import av

    source = tmp_path / "source.mkv"
    rng = np.random.default_rng(2)
    base = rng.integers(0, 256, (48, 64, 3), np.uint8)
    with av.open(str(source), "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.options = {"bframes": "0", "g": "8", "keyint_min": "8", "sc_threshold": "0"}
        frames = [np.roll(base, 5 * k, axis=1) for k in range(24)]
        mux_frames(container, stream, frames, Fraction(1, 8))
    with av.open(str(source)) as opened:
        video = opened.streams.video[0]
        packets = [p for p in opened.demux(video) if p.size][3:]  # from a P-frame on
        buf = io.BytesIO()
        with av.open(buf, "w", format="matroska") as cut:
            out = cut.add_stream_from_template(video)
            for packet in packets:
                packet.stream = out
                cut.mux(packet)
    whole, planned = both(processor, buf.getvalue(), fps=4.0, max_frames=768)
    assert_same(processor, whole, planned)
    once = open_video(buf.getvalue(), fps=4.0, max_frames=768, planner=planner_of(processor))
    once.decode()
    assert once._decoded <= len(packets)  # one pass
