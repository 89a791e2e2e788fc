"""What a request's media take while the router decodes and processes them, against what it
reserved for them from their headers (`max_media_bytes`, the in-flight reservation): a
video file's frames are decoded in place and made images one at a time, and patch codes are
written without a padded copy of the frames (ownfix review: a video file peaked at 2.25x
what it reserved, an image's processing at twice what was counted)."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np

from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.processing.image import patch_codes
from tests.test_video_file import make_video

_PEAK = """
import sys
from common.models.tiny import default_checkpoint
from common.processing.limits import InputLimits
from common.processing.processor import Processor
from epd.v1 import router_service_pb2
from router.inputs import messages_from_proto

processor = Processor.from_pretrained(default_checkpoint("tiny"))

def answer(path):
    request = router_service_pb2.GenerateRequest()
    message = request.messages.add(role="user")
    message.content.add().video.file = open(path, "rb").read()
    message.content.add().text = "What happens?"
    reserved = []
    limits = InputLimits(video_file_fps=8.0)
    processor.process(
        messages_from_proto(request.messages, limits, processor, reserve=reserved.append)
    )
    return reserved[0]

def status(field):  # bytes
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

for _ in range(2):
    answer(sys.argv[1])  # every path taken once
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # the peak is now what is resident
before = status("VmRSS")
reserved = answer(sys.argv[2])
print(status("VmHWM") - before, reserved)
"""


def test_a_video_file_takes_about_what_its_request_reserved(tmp_path: Path) -> None:
    small, big = tmp_path / "small.mp4", tmp_path / "big.mp4"
    small.write_bytes(make_video(frames=4, size=(64, 64)))
    big.write_bytes(make_video(frames=32, size=(1280, 720)))  # 88 MB of frames decoded
    run = subprocess.run(
        [sys.executable, "-c", _PEAK, str(small), str(big)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    grown, reserved = (int(v) for v in run.stdout.split())
    # Here: 1.16 (glibc's heap beside FFmpeg); a list of frames stacked, and every frame
    # made an image at once, took it to 2.25.
    assert grown < 1.5 * reserved, (grown, reserved)


def test_patch_codes_make_no_padded_copy_of_the_frames() -> None:
    # An image is two frames in time: its padded copy was twice its pixels, beside them and
    # the codes.
    settings = ProcessorSettings()
    frames = np.random.default_rng(0).integers(0, 256, (1, 448, 448, 3), dtype=np.uint8)
    tracemalloc.start()
    try:
        codes, _ = patch_codes(frames, settings)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert codes.nbytes == 2 * frames.nbytes
    assert peak < 1.2 * codes.nbytes, (peak, codes.nbytes)
