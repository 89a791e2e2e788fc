"""Why a NIXL agent is made before a worker serves: UCX, as the agent is made, hooks the calls
that move the program break (brk, sbrk) and tests the hooks by moving the break; a thread
growing glibc's main heap meanwhile then finds the break below the heap's top, and glibc
aborts the process ("break adjusted to free malloc space", or a segfault later).

    python scripts/ucx_hooks_race.py [RUNS] [--after]

runs RUNS fresh processes (default 100) in which the main thread mallocs and frees (the
main arena, growing and trimming the break) while another thread makes an agent, and
prints how many died; with `--after`, the agent is made first, then the same churn runs
(the hooks installed, nothing beside their making). Seen here (2 cores): 3 of 100 died
beside the making (one abort with that message, two SIGSEGV); after it, 0 of 100.

An encoder made its agent so, after it began serving, and a restarted one aborted with that
message under load (chaos review, session 37); every worker now makes its agent before its
server starts (`encoder_worker.server.serve`, `common.server.kv_worker.KvWorkerParts.make`).
"""

from __future__ import annotations

import ctypes
import random
import subprocess
import sys
import threading


def one(seed: int, after: bool) -> None:
    """The race, once, in this process (exits 0 if it lived); `after`: no race, the agent
    made before the churn."""
    from common.transfer.agent import TransferAgent

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    made = threading.Event()

    def make() -> None:
        TransferAgent("race")
        made.set()

    thread = threading.Thread(target=make)
    thread.start()
    if after:
        thread.join()
    rng = random.Random(seed)
    rounds = 0
    while rounds < 50 if after else not made.is_set():
        rounds += 1
        # Below the mmap threshold: the main arena's, growing the break, trimmed after.
        held = [libc.malloc(rng.randrange(1024, 120_000)) for _ in range(200)]
        for pointer in held:
            libc.free(pointer)
        libc.malloc_trim(0)
    thread.join()


def main(runs: int, after: bool) -> int:
    died = 0
    for seed in range(runs):
        code = [sys.executable, __file__, "--one", str(seed), *(["--after"] if after else [])]
        done = subprocess.run(code, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            died += 1
            last = (done.stderr.strip().splitlines() or [""])[-1]
            print(f"run {seed}: exit {done.returncode}: {last}", flush=True)
    print(f"{died} of {runs} processes died")
    return 0


if __name__ == "__main__":
    after = "--after" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--after"]
    if args[:1] == ["--one"]:
        one(int(args[1]), after)
    else:
        sys.exit(main(int(args[0]) if args else 100, after))
