"""A request's media budget (`common.processing.limits.MediaBudget`): what one item takes
for a while is its own, counted at the most any of its images or frames takes, whatever
the order of the items (s35diff and ownfix reviews, s36)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from common.processing.limits import InputLimits, MediaBudget
from common.processing.processor import Processor


def test_a_videos_frames_count_the_most_one_frame_takes_for_a_while() -> None:
    # Frames with transparency before a plain last one: the last frame's transient alone
    # was counted for the video's processing (s35diff review, s36).
    budget = MediaBudget(InputLimits())
    budget.begin()
    budget.add(100, 100, "frames[0]", 4, 8)  # made RGB: 8 bytes a pixel for a while
    budget.add(100, 100, "frames[1]", 4, 0)  # plain RGB
    budget.briefly(1000, "frames")  # processing the video beside its frames' most
    assert budget.transient == 100 * 100 * 8 + 1000
    budget.begin()  # the next item's own
    budget.add(10, 10, "image", 4, 0)
    budget.briefly(10, "image")
    assert budget.transient == 100 * 100 * 8 + 1000  # the request's most stays


@pytest.mark.parametrize("big", ["image", "frames"])
def test_what_an_item_takes_for_a_while_is_its_own_in_any_order(
    processor: Processor, big: str
) -> None:
    # Each item begins its own count: without it, a big plain item after a small one with
    # transparency was counted with the other's RGB conversion, and a request reserved
    # more in one order than in the other (ownfix review, s36).
    from epd.request import build_request
    from router.inputs import messages_from_proto

    rgba = io.BytesIO()
    Image.new("RGBA", (96, 96)).save(rgba, "PNG")  # more for a while than it keeps
    rng = np.random.default_rng(3)
    plain = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(plain, "PNG")
    part: dict[str, Any] = (
        {"type": "image", "image": plain.getvalue()}
        if big == "image"
        else {"type": "video", "video": [plain.getvalue()] * 2, "fps": 2.0}
    )

    def reserved(*parts: dict[str, Any]) -> int:
        got: list[int] = []
        request = build_request([{"role": "user", "content": [*parts]}])
        messages_from_proto(request.messages, processor=processor, reserve=got.append)
        return got[0]

    small = {"type": "image", "image": rgba.getvalue()}
    assert reserved(small, part) == reserved(part, small)
