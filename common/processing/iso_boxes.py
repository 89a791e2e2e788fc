"""How many frames an ISO base media file (mp4, mov) declares, read from its boxes before
FFmpeg sees the bytes.

FFmpeg's mov demuxer builds an index entry for every video sample the file declares while
it opens the file, before any header can be checked. A sample table with one constant size
(`stsz` with a sample size) or a fragment's run without per-sample fields (`trun`) declares
any count in a few bytes: a 2.6 KB file declaring 60 million frames took 2.1 GB to open.
`declared_frames` reads those counts so the caller can refuse such a file first.

Boxes read: `moov/trak/mdia/hdlr` (is the track video?) and `.../minf/stbl/stsz|stz2` (its
sample count), and `moof/traf/trun` (each run's sample count; a fragment names its track
by id only, so every track's runs are counted). Nothing else is interpreted; a malformed
box ends the walk (FFmpeg then refuses the file, or reads what it can).
"""

from __future__ import annotations

import struct
from typing import Final

# Boxes whose children are boxes, on the paths read here.
_CONTAINERS: Final = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"moof", b"traf"})
# Boxes visited at most: a legitimate file has tens (hundreds when fragmented); a file of
# millions of empty boxes is refused rather than walked.
MAX_BOXES: Final = 100_000


class TooManyBoxes(ValueError):
    """The file holds more than `MAX_BOXES` boxes on the paths walked."""


def declared_frames(data: bytes) -> int:
    """The most video samples any one track's sample table declares, plus every fragment
    run's samples. Raises `TooManyBoxes`."""
    walk = _Walk(data)
    walk.boxes(0, len(data), None)
    return max(walk.track_samples, default=0) + walk.run_samples


class _Walk:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.visited = 0
        self.track_samples: list[int] = []  # per video track: its sample table's count
        self.run_samples = 0  # every fragment run's count, summed
        self._video = False  # the track being walked is video (its `hdlr` came first)
        self._count = 0  # its sample table's count

    def boxes(self, start: int, end: int, parent: bytes | None) -> None:
        data = self.data
        at = start
        while at + 8 <= end:
            self.visited += 1
            if self.visited > MAX_BOXES:
                raise TooManyBoxes(f"holds more than {MAX_BOXES} boxes")
            size, kind = struct.unpack_from(">I4s", data, at)
            header = 8
            if size == 1 and at + 16 <= end:  # a 64-bit size follows
                size = struct.unpack_from(">Q", data, at + 8)[0]
                header = 16
            elif size == 0:  # to the end of the enclosing box
                size = end - at
            if size < header or at + size > end:
                return  # malformed: FFmpeg judges the rest
            body = at + header
            if kind == b"trak":
                self._video, self._count = False, 0
                self.boxes(body, at + size, kind)
                if self._video:
                    self.track_samples.append(self._count)
            elif kind in _CONTAINERS:
                self.boxes(body, at + size, kind)
            elif kind == b"hdlr" and parent == b"mdia" and body + 12 <= at + size:
                self._video = data[body + 8 : body + 12] == b"vide"
            elif kind in (b"stsz", b"stz2") and parent == b"stbl" and body + 12 <= at + size:
                self._count = struct.unpack_from(">I", data, body + 8)[0]
            elif kind == b"trun" and parent == b"traf" and body + 8 <= at + size:
                self.run_samples += struct.unpack_from(">I", data, body + 4)[0]
            at += size
