"""What this machine's CPU can do, as Linux reports it: kernels are chosen by it where the
faster one differs between CPUs (`common.models.qwen3_vl.linear.packing_pays`,
`common.kv.digest`); and how a thread of ours runs torch on it (`torch_thread`)."""

from __future__ import annotations

import functools
from pathlib import Path


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """The `vendor_id` and `flags` of this machine's CPU ("" and none where Linux does not
    say), from its first processor's lines."""
    vendor, flags = "", frozenset[str]()
    try:
        with cpuinfo.open() as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                elif not key and (vendor or flags):
                    break  # the first processor's block ended
    except OSError:
        pass
    return vendor, flags


@functools.cache
def int8_dot_products() -> bool:
    """Whether the CPU multiplies int8 vectors natively (VNNI: `avx512_vnni`, `avx_vnni`,
    or AMX's `amx_int8`), which torch's int8 GEMM needs to run at memory speed: without it
    (AVX2 only) `torch._int_mm` ran at 0.08 GB/s on an AMD EPYC, where a float32 GEMM of
    the same integers ran at 1.4 GB/s."""
    return bool(cpu_info()[1] & {"avx512_vnni", "avx_vnni", "amx_int8"})


def torch_thread() -> None:
    """Initializer of a thread that runs torch work (the model thread; KV and embedding
    digests after a NIXL READ): it takes the process's torch thread count
    (`common.server.threads.apply`). OpenMP's count is per thread, and torch sets it in a
    thread only at that thread's first parallel op of its own: one whose first call is a
    matrix product (BLAS, oneDNN) starts a team of a thread per core, whose idle workers
    spin between calls (a served decode worker on 2 cores spent ~2 ms of CPU a request so
    on digests of 6 blocks; perf14 review, s43)."""
    import torch

    torch.set_num_threads(torch.get_num_threads())  # (the get sets this thread's count)
