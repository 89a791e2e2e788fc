"""glibc malloc settings for a process that runs model forwards on the CPU.

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

`tune_malloc` sets the mmap threshold to 32 MB (glibc's ceiling for it; larger blocks, such
as the paged KV buffer, still get their own mapping) and the trim threshold to 256 MB, so
freed activations stay in the heap for the next op. The trim threshold holds for each of
malloc's arenas, and glibc makes up to eight per core (a thread takes a free one, or a new
one): a prefill worker under load kept 12 arenas of 38-62 MB, 850 MB resident after 150 s
idle against 290 MB at start, and eight threads each using and freeing 120 MB left 560-600
MB more resident in 9 arenas. So it also caps the arenas at `ARENA_MAX`, which threads then
share (the same eight threads: 210-380 MB more, in 2 arenas). Process-wide and
idempotent; a no-op where the C library has no `mallopt` (not glibc). Arenas made before
it runs stay (a worker calls it as its model loads, before it serves).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
ARENA_MAX = 2  # malloc arenas the process's threads share
MMAP_THRESHOLD = 32 << 20  # bytes; glibc refuses more (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20  # bytes of free heap top kept before returning it

_tuned = False


def tune_malloc() -> bool:
    """Apply the thresholds above to this process's malloc; True if they are in effect."""
    global _tuned
    if _tuned:
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
        bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))
    )
    if not ok:
        logger.warning("mallopt refused the malloc thresholds; forwards may fault pages in")
    _tuned = ok
    return ok
