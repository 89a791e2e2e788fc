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
gives every block of 1 MB or more its own mapping, returned when freed, and trims the heap
past 8 MB: the router's memory then follows the bytes it holds.

Process-wide and idempotent (the first profile applied stays); a no-op where the C library
has no `mallopt` (not glibc). Arenas made before it runs stay (a worker calls it as its
model loads, the router as it makes its preparing threads, before either serves).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

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
MEDIA = MallocProfile(1 << 20, 8 << 20)  # freed media go back to the kernel

_tuned: MallocProfile | None = None


def tune_malloc(profile: MallocProfile = FORWARDS) -> bool:
    """Apply `profile` to this process's malloc, unless one was; True if one is in effect."""
    global _tuned
    if _tuned is not None:
        if _tuned != profile:
            logger.debug("malloc already tuned for %s; %s not applied", _tuned, profile)
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
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
