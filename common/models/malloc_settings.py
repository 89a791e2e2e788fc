"""glibc malloc settings for a process that runs model forwards on the CPU (`FORWARDS`), and
for the router, which decodes media (`MEDIA`).

Every op of a forward allocates its output and frees its inputs' temporaries: tensors of
hundreds of KB to a few MB (a 512-token prefill's gate/up activations are 3 MB). With glibc's
defaults the heap returns freed memory above 128 KB at its top to the kernel (trim), and
the mmap threshold, which adapts to the largest block freed so far, never settles while
the sizes vary between prefill and decode; the next allocation then faults its pages in
again and the kernel zeroes them. On one torch thread that cost about 8% of a 512-token
prefill and 3% of a batch-32 decode step on the "small" checkpoint (the same code with and
without these thresholds, in two processes, interleaved, medians of 21), and about 6% of
the "bench" vision tower's forward over one 448x448 image (478 -> 450 ms CPU). The LM
runner and the encoder engine set them when they start.

`tune_malloc(FORWARDS)` sets the mmap threshold to 32 MB (glibc's ceiling for it; larger
blocks, such as the paged KV buffer, still get their own mapping) and the trim threshold to
256 MB, so freed activations stay in the heap for the next op. The trim threshold holds for each of
malloc's arenas, and glibc makes up to eight per core (a thread takes a free one, or a new
one): a prefill worker under load kept 12 arenas of 38-62 MB, 850 MB resident after 150 s
idle against 290 MB at start, and eight threads each using and freeing 120 MB left 560-600
MB more resident in 9 arenas. So it also caps the arenas at `ARENA_MAX`, which threads then
share (the same eight threads: 210-380 MB more, in 2 arenas).

The router is the opposite case: a request's media are buffers of 1 to 32 MB (encoded
bytes, base64 text, decoded pixels, Pillow's 16 MB blocks) held a few seconds, then freed
all at once, and nothing needs them again. Under glibc's adaptive threshold they came from
the heap and stayed resident: after bursts of photos a router kept 0.6-1.4 GB it no longer
used, and peaked at twice `requests_in_flight_mb` above idle (burstmem review). `MEDIA`
gives every block of 8 MB or more its own mapping, returned when freed, and trims the heap
past 8 MB (a burst of 302 MB of photos left 35 MB resident, against 202 MB; a 1 MB
threshold left 7 MB but cost a cached image's request 50% more CPU in page faults); the
router also gives back the heap's free holes once its preparing threads are idle
(`release_free_memory`).

Process-wide and idempotent (`FORWARDS`, once applied, stays); a no-op where the C library
has no `mallopt` (not glibc). Arenas made before it runs stay (a worker calls it as its
model loads, the router as it makes its preparing threads, before either serves).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
ARENA_MAX = 2  # malloc arenas the process's threads share


@dataclass(frozen=True)
class MallocProfile:
    mmap_threshold: int  # bytes from which a block gets its own mapping; glibc caps it at 32 MB
    trim_threshold: int  # bytes of free heap top kept before returning it
    arena_max: int = ARENA_MAX


FORWARDS = MallocProfile(32 << 20, 256 << 20)  # freed activations stay for the next op
MEDIA = MallocProfile(8 << 20, 8 << 20)  # freed media go back to the kernel

_tuned: MallocProfile | None = None


def tune_malloc(profile: MallocProfile = FORWARDS) -> bool:
    """Apply `profile` to this process's malloc; True if it is in effect. `FORWARDS`, once
    applied, stays: where one process runs forwards and a router (tests), the forwards are
    the costlier side (10-15% slower under `MEDIA`; ownfix review)."""
    global _tuned
    if _tuned == profile:
        return True
    if _tuned == FORWARDS:
        logger.info("malloc is tuned for model forwards; %s not applied", profile)
        return False
    mallopt = _libc("mallopt")
    if mallopt is None:
        logger.debug("no mallopt in the C library: malloc thresholds left as they are")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = (
        bool(mallopt(_M_MMAP_THRESHOLD, profile.mmap_threshold))
        and bool(mallopt(_M_TRIM_THRESHOLD, profile.trim_threshold))
        and bool(mallopt(_M_ARENA_MAX, profile.arena_max))
    )
    if not ok:
        logger.warning("mallopt refused the malloc thresholds %s", profile)
    _tuned = profile if ok else None
    return ok


_trim: Callable[[int], int] | None = None  # malloc_trim, or a no-op where there is none


def release_free_memory() -> bool:
    """Give the kernel the free memory inside malloc's heaps, holes included (glibc's
    `malloc_trim(0)`): the trim threshold returns only a heap's free top, and what lives on
    (an encoder's cache) pins the holes under it. After a burst of images an encoder kept
    0.9-1.0 GB beyond its cache at rest (workermem review). True if memory was returned; a
    no-op where the C library has no `malloc_trim`."""
    global _trim
    if _trim is None:
        trim = _libc("malloc_trim")
        if trim is None:
            _trim = _none  # looked up once (ldconfig runs for it)
        else:
            trim.argtypes = (ctypes.c_size_t,)
            trim.restype = ctypes.c_int
            _trim = trim
    return bool(_trim(0))


def _libc(name: str) -> Any:
    """The C library's function `name`, None where there is none (not glibc)."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


def _none(pad: int) -> int:
    return 0


# Seconds idle after which what was freed is given back (`wait_or_release`).
IDLE_RELEASE_S = 0.5


async def wait_or_release(event: asyncio.Event, release: bool) -> bool:
    """Wait for `event`; with `release`, once `IDLE_RELEASE_S` pass first, give what was
    freed back to the kernel (`release_free_memory`, on a thread) and return False: an
    encoder's cache, which lives on, pins the heap's holes its batches freed."""
    if not release:
        await event.wait()
        return True
    try:
        async with asyncio.timeout(IDLE_RELEASE_S):
            await event.wait()
        return True
    except TimeoutError:
        await asyncio.to_thread(release_free_memory)
        return False
