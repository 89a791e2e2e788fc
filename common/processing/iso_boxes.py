"""What an ISO base media file (mp4, mov) declares in its sample tables, read from its boxes
before FFmpeg sees the bytes, and the refusals that follow (`check_mp4`).

FFmpeg's mov demuxer builds an index entry for every sample of every track the file
declares while it opens the file, before any header can be checked. A sample table with one
constant size (`stsz` with a sample size) or a fragment's run without per-sample fields
(`trun`) declares any count in a few bytes: a 2.6 KB file declaring 60 million frames took
2.1 GB to open. So, before FFmpeg:
- the samples every table declares, summed over every track and fragment run (`stsz`,
  `stz2`, `trun`), and the samples of any one chunk (`stsc`: uncompressed sound is indexed
  by chunk) must fit in the file's bytes (a sample is at least one byte). These are found
  by type anywhere outside `mdat` (`scan_tables`), as FFmpeg finds them; a video track's
  frames, by the structural walk (`declared`), must fit `max_seconds` at `MAX_SOURCE_RATE`;
- a compressed movie header (`cmov`, which FFmpeg inflates and no scan here reads), more
  than `MAX_TRACKS` tracks and more than `MAX_EDITS` edit-list entries (each copies the
  index entries it covers) are refused.
What this leaves: samples bound by bytes still cost FFmpeg some 24 bytes of index each, and
sound chunks are bounded one by one, not their sum.

Boxes are read as FFmpeg reads them (`_boxes`). The structural walk reads
`moov/trak/mdia/hdlr` (is the track video?), `.../minf/stbl/stsz|stz2` (its samples) and
`moof/traf/trun` (a fragment's; a fragment names its track by id only, so all runs are
counted together).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from common.errors import FieldError
from common.processing.limits import LimitError

# Boxes whose children are boxes, on the paths read here.
_CONTAINERS: Final = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"moof", b"traf"})
# Boxes visited at most: a fragment per frame of a 10-minute 60 fps video with sound is some
# 400,000; a file of millions of empty boxes is refused rather than walked.
MAX_BOXES: Final = 1_000_000
MAX_TRACKS: Final = 16  # as `common.processing.video_file.MAX_STREAMS`


@dataclass(slots=True)
class Table:
    """One track's sample table."""

    video: bool  # its `hdlr` says vide
    samples: int  # its `stsz`/`stz2` count


@dataclass(slots=True)
class Declared:
    """What the boxes declare."""

    tables: list[Table] = field(default_factory=list)
    run_samples: int = 0  # every fragment run's count, summed
    boxes: int = 0  # boxes visited

    @property
    def video_frames(self) -> int:
        """The most frames a video track declares, plus the fragments' samples."""
        return max((t.samples for t in self.tables if t.video), default=0) + self.run_samples


def declared(data: bytes) -> Declared:
    """Walk the boxes of `data`; ValueError past `MAX_BOXES`."""
    out = Declared()
    _walk(data, 0, len(data), None, out, None)
    return out


def check_mp4(
    data: bytes, max_seconds: float | None, max_rate: float, slack: float, field_name: str
) -> None:
    """Refuse (`FieldError`, `LimitError` naming `field_name`) an mp4 whose boxes declare more
    than its bytes, or its video more than `max_seconds` at `max_rate` frames a second (times
    `slack`), can hold; or one FFmpeg would read otherwise than this walk (see the module
    docstring)."""
    try:
        found = declared(data)
    except ValueError as exc:
        raise FieldError(field_name, str(exc)) from None
    tables = scan_tables(data)
    if tables.get(b"cmov"):
        raise FieldError(field_name, "has a compressed movie header (cmov), not supported")
    if tables.get(b"trak", 0) > MAX_TRACKS:
        raise FieldError(field_name, f"holds more than {MAX_TRACKS} tracks")
    samples = tables.get(b"stsz", 0) + tables.get(b"stz2", 0) + tables.get(b"trun", 0)
    # One chunk cannot hold more samples than the file's bytes (uncompressed sound is indexed
    # by chunk, in pieces of a thousand samples or so).
    most_declared = max(samples, tables.get(b"stsc", 0))
    if most_declared > len(data):
        raise FieldError(
            field_name, f"declares {most_declared} samples, more than its {len(data)} bytes hold"
        )
    if tables.get(b"elst", 0) > MAX_EDITS:
        raise FieldError(field_name, f"has more than {MAX_EDITS} edit-list entries")
    if max_seconds is None:
        return
    most = max(math.ceil(max_seconds * max_rate * slack), 16)
    if found.video_frames > most:
        raise LimitError(
            field_name,
            f"declares {found.video_frames} frames; max_video_seconds = {max_seconds:g} at up "
            f"to {max_rate:g} frames per second holds at most {most}",
        )


# Where each table box keeps the count read (after its 4CC): `stsz`, `stz2` and `trun` their
# samples, `stco`/`co64` their chunks, `elst` its edits; `stsc` (per entry) the samples of a
# chunk (the largest is kept).
_COUNT_AT: Final = {b"stsz": 12, b"stz2": 12, b"trun": 8, b"stco": 8, b"co64": 8, b"elst": 8}
MAX_EDITS: Final = 64  # edit-list entries in all: each copies the samples it covers


def scan_tables(data: bytes) -> dict[bytes, int]:
    """Sample tables found by their type anywhere outside the `mdat` boxes, wherever they
    sit and whatever sizes their boxes claim (FFmpeg reads a table wherever it meets one,
    parses a moov renamed `free` or `hoov`, and reads a table's fields past a box too short
    for them): the summed counts of `_COUNT_AT`'s, the largest samples per chunk of any
    `stsc` entry (b"stsc"), and how many `trak` and `cmov` boxes there are. A type counts
    only where it starts a box: its size field before it fits the bytes left (text such as
    a title reading "Elephant trunk" has letters there, a size past any header)."""
    found: dict[bytes, int] = {}
    for start, end in _outside_mdat(data):
        region = data[start:end]
        for kind in (*_COUNT_AT, b"stsc", b"trak", b"cmov"):
            at = region.find(kind)
            while at >= 0:
                size = _u32(region, at - 4) if at >= 4 else -1
                boxed = size in (0, 1) or 8 <= size <= len(region) - at + 4
                if boxed and not _text(region, at):
                    found[kind] = _counted(found.get(kind, 0), kind, region, at)
                at = region.find(kind, at + 4)
    return found


def _text(region: bytes, at: int) -> bool:
    """Whether the bytes at `at` are a metadata value's text: inside a `data` box's body
    (its 8-byte type and locale, often zeros, then the text: a title "truncated take")."""
    return region[at - 12 : at - 8] == b"data" and _u32(region, at - 16) > 16


def _counted(total: int, kind: bytes, region: bytes, at: int) -> int:
    """`total` with the box of `kind` at `at` (its 4CC) counted in (see `scan_tables`)."""
    if kind in _COUNT_AT:
        return total + _u32(region, at + _COUNT_AT[kind])
    if kind == b"stsc":
        entries = min(_u32(region, at + 8), max(0, len(region) - at - 12) // 12)
        return max(total, *(_u32(region, at + 16 + 12 * i) for i in range(entries)), 0)
    return total + 1


def _u32(data: bytes, at: int) -> int:
    """The big-endian uint32 at `at`, 0 past the end."""
    return struct.unpack_from(">I", data, at)[0] if at + 4 <= len(data) else 0


def _outside_mdat(data: bytes) -> list[tuple[int, int]]:
    """The byte ranges of the top-level boxes other than `mdat` (FFmpeg reads no box inside
    one); from an unreadable size on, the rest."""
    return [(at, stop) for kind, at, _, stop in _boxes(data, 0, len(data)) if kind != b"mdat"]


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int, int]]:
    """(type, start, body, stop) of each box in `data[start:end]`, read as FFmpeg reads
    them: a size of 1 is followed by a 64-bit one, 0 runs to `end`, a box past `end` is cut
    to it. An unreadable size ends them, as (b"", its start, its start, `end`)."""
    at = start
    while at + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, at)
        header = 8
        if size == 1 and at + 16 <= end:
            size, header = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:
            size = end - at
        if size < header:
            yield b"", at, at, end
            return
        stop = min(at + size, end)
        yield kind, at, at + header, stop
        at = stop


def _walk(
    data: bytes, start: int, end: int, parent: bytes | None, out: Declared, trak: Table | None
) -> None:
    for kind, _, body, stop in _boxes(data, start, end):
        out.boxes += 1
        if out.boxes > MAX_BOXES:
            raise ValueError(f"holds more than {MAX_BOXES} boxes")
        if kind == b"trak":
            table = Table(video=False, samples=0)
            _walk(data, body, stop, kind, out, table)
            out.tables.append(table)
        elif kind in _CONTAINERS:
            _walk(data, body, stop, kind, out, trak)
        elif trak is not None and kind == b"hdlr" and parent == b"mdia" and body + 12 <= stop:
            trak.video = data[body + 8 : body + 12] == b"vide"
        elif trak is not None and kind in (b"stsz", b"stz2") and parent == b"stbl":
            trak.samples = _u32(data, body + 8)
        elif kind == b"trun" and parent == b"traf":
            out.run_samples += _u32(data, body + 4)
