"""KV pull throughput: `TransferAgent.read` over per-block descriptors vs one raw NIXL READ.

Two processes on one machine (NIXL over UCX, host memory). A holder registers a block-major
buffer; the reader pulls N blocks of B bytes in four ways, per (size, block size):

  raw-1      one raw NIXL READ descriptor of N*B bytes (the ceiling)
  raw-N      raw NIXL READ with N adjacent per-block descriptors (no merging by us)
  read-adj   our `read` with N adjacent per-block ranges (merged into one descriptor)
  read-scat  our `read` with N blocks spaced one block apart remotely (cannot merge)
  read-np    read-adj with the ranges as Nx2 numpy arrays instead of lists of tuples

Reports the median GB/s over repetitions and ratios against raw-1 (goal: read-adj >= 0.9x).

    .venv/bin/python benchmarks/kv_pull_bench.py [--sizes-mib 4 16 64] [--reps 9]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import measure

from common.transfer.agent import TransferAgent

MIB = 1 << 20
KIB = 1 << 10


def holder_main(conn: Connection, nbytes: int) -> None:
    """Register `nbytes` of host memory, send metadata and address, wait for any message."""
    torch.set_num_threads(1)
    agent = TransferAgent("bench-holder")
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    agent.register(buf)
    conn.send_bytes(msgpack.packb({"metadata": agent.metadata(), "addr": buf.data_ptr()}))
    conn.recv_bytes()
    agent.close()


def raw_read(
    agent: TransferAgent, peer: str, remote: list[tuple[int, int]], local: list[tuple[int, int]]
) -> None:
    """A raw NIXL READ: descriptors as given, tight polling, no validation or merging."""
    nixl = agent._agent
    handle = nixl.initialize_xfer(
        "READ",
        nixl.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM"),
        nixl.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM"),
        peer,
    )
    state = nixl.transfer(handle)
    while state == "PROC":
        state = nixl.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"raw READ failed: {state}")
    handle.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)

    max_bytes = max(args.sizes_mib) * MIB
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # Twice the largest size, so the scattered case can skip every other block.
    proc = ctx.Process(target=holder_main, args=(child, 2 * max_bytes), daemon=True)
    proc.start()
    info = msgpack.unpackb(parent.recv_bytes())
    agent = TransferAgent("bench-reader")
    peer = agent.add_peer(info["metadata"])
    base = info["addr"]
    local_buf = torch.zeros(max_bytes, dtype=torch.uint8)
    agent.register(local_buf)
    dst = local_buf.data_ptr()

    print("GB/s = median over repetitions; x = median of per-repetition ratios to raw-1")
    print(
        f"{'size':>6} {'block':>6} {'descs':>5} {'raw-1':>7} {'raw-N':>7} {'read-adj':>8} "
        f"{'read-scat':>9} {'read-np':>7} {'adj x':>6} {'scat x':>6} {'np x':>6} "
        f"{'raw-N x':>7}"
    )
    for size_mib in args.sizes_mib:
        nbytes = size_mib * MIB
        for block_kib in args.block_kib:
            block = block_kib * KIB
            n = nbytes // block
            local = [(dst + i * block, block) for i in range(n)]
            adjacent = [(base + i * block, block) for i in range(n)]
            scattered = [(base + 2 * i * block, block) for i in range(n)]
            adjacent_np, local_np = np.array(adjacent), np.array(local)
            times = measure(
                {
                    "raw-1": lambda: raw_read(agent, peer, [(base, nbytes)], [(dst, nbytes)]),  # noqa: B023
                    "raw-N": lambda: raw_read(agent, peer, adjacent, local),  # noqa: B023
                    "read-adj": lambda: agent.read(peer, adjacent, local, timeout_s=30),  # noqa: B023
                    "read-scat": lambda: agent.read(peer, scattered, local, timeout_s=30),  # noqa: B023
                    "read-np": lambda: agent.read(peer, adjacent_np, local_np, timeout_s=30),  # noqa: B023
                },
                args.reps,
            )
            gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            ratio = {
                k: statistics.median(b / t for b, t in zip(times["raw-1"], v, strict=True))
                for k, v in times.items()
            }
            print(
                f"{size_mib:>4}Mi {block_kib:>4}Ki {n:>5} {gbps['raw-1']:>7.2f} "
                f"{gbps['raw-N']:>7.2f} {gbps['read-adj']:>8.2f} {gbps['read-scat']:>9.2f} "
                f"{gbps['read-np']:>7.2f} {ratio['read-adj']:>6.2f} {ratio['read-scat']:>6.2f} "
                f"{ratio['read-np']:>6.2f} {ratio['raw-N']:>7.2f}",
                flush=True,
            )

    parent.send_bytes(b"stop")
    proc.join(10)
    agent.close()


if __name__ == "__main__":
    main()
