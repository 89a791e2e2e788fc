"""Decode-side KV pull throughput: the decode worker's real pull path vs one raw NIXL READ.

Two processes on one machine (NIXL over UCX, host memory), both `LmRunner`s of the same
checkpoint (default: the "bench" tiny size, bf16, 16-token blocks = 128 KiB per block). The
holder builds real `KvHandle`s with the prefill worker's own code (`PrefillServicer`, one
descriptor per block into its registered block-major buffer); the reader pulls them with
the decode worker's own code (`KvAllocator.plan_import` + `common.kv_pull.pull`:
ranges from the handle, adjacent blocks merged, READ on a worker thread, then the pulled
blocks' digests checked against the handle's). Per size and holder block pattern:

  raw-1   one raw NIXL READ descriptor of the same bytes (the ceiling)
  read    `TransferAgent.read` of the same per-block ranges, called directly (no check)
  read+v  the read, then `cache_block_digests` of the pulled blocks compared with the
          digests the holder computed of its blocks (issue 9's payload check, alone)
  pull    the decode pull path from the KvHandle (what `DecodeServicer` runs; it verifies)

Holder block patterns: `contiguous` (a fresh pool: merges into one descriptor), `alternate`
(every other block: one descriptor per block), `random` (a churned pool). Reports the median
GB/s over repetitions (round-robin), the median per-repetition throughput ratio pull / raw-1
(`x`) and the median per-repetition time ratio (read+v) / read (`v/r`: what verifying costs
the READ).

    .venv/bin/python benchmarks/kv_decode_pull_bench.py [--sizes-mib 4 16 64] [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing as mp
import statistics
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import measure

from common.handoff import build_handle
from common.kv.allocator import ImportPlan, KvAllocator
from common.kv.digest import cache_block_digests
from common.kv_pull import pull
from common.models.runner import LmRunner
from common.models.tiny import default_checkpoint
from common.transfer.agent import TransferAgent
from epd.v1 import kv_pb2

MIB = 1 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def holder_main(conn: Connection, ckpt: str, dtype: str, block_size: int, blocks: int) -> None:
    """A prefill-side runner whose block b holds the byte b % 251; answers handle requests
    (the handle carries the blocks' digests, computed here as the prefill worker does)."""
    torch.set_num_threads(1)
    runner = LmRunner.from_pretrained(
        ckpt, dtype=DTYPES[dtype], block_size=block_size, num_blocks=blocks
    )
    raw = runner.kv.buffer.view(-1).view(torch.uint8).view(blocks, -1)
    raw.copy_((torch.arange(blocks, dtype=torch.int64) % 251).to(torch.uint8)[:, None])
    agent = TransferAgent("bench-prefill")
    agent.register(runner.kv.buffer)  # as the prefill worker does, once
    metadata = agent.metadata()
    conn.send_bytes(msgpack.packb(runner.kv.buffer.data_ptr()))
    while True:
        msg = msgpack.unpackb(conn.recv_bytes())
        if msg is None:
            break
        ids = [int(b) for b in msg["blocks"]]
        handle = build_handle(
            runner,
            ids,
            [],
            num_tokens=len(ids) * block_size,
            prompt_digest=bytes(32),  # not checked here
            block_digests=cache_block_digests(runner.kv, ids),
            agent=agent,
            agent_metadata=metadata,
            lease_id="bench",
            lease_ttl_s=3600.0,
            holder_address="",
            key=None,
        )
        conn.send_bytes(handle.SerializeToString())
    agent.close()


def raw_read(
    agent: TransferAgent, peer: str, remote: tuple[int, int], local: tuple[int, int]
) -> None:
    """One raw NIXL READ descriptor, tight polling (the ceiling)."""
    nixl = agent._agent
    handle = nixl.initialize_xfer(
        "READ",
        nixl.get_xfer_descs([(local[0], local[1], 0)], "DRAM"),
        nixl.get_xfer_descs([(remote[0], remote[1], 0)], "DRAM"),
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
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--checkpoint", default=None, help="default: the bench tiny model")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ckpt = args.checkpoint or str(default_checkpoint("bench"))

    reader = LmRunner.from_pretrained(
        ckpt, dtype=DTYPES[args.dtype], block_size=args.block_size, num_blocks=1
    )
    block_bytes = reader.kv.spec.block_bytes
    max_blocks = max(args.sizes_mib) * MIB // block_bytes
    reader = LmRunner.from_pretrained(
        ckpt, dtype=DTYPES[args.dtype], block_size=args.block_size, num_blocks=max_blocks
    )
    agent = TransferAgent("bench-decode")
    agent.register(reader.kv.buffer)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    holder_blocks = 2 * max_blocks  # room for the alternate pattern
    proc = ctx.Process(
        target=holder_main,
        args=(child, ckpt, args.dtype, args.block_size, holder_blocks),
        daemon=True,
    )
    proc.start()
    holder_base = msgpack.unpackb(parent.recv_bytes())
    loop = asyncio.new_event_loop()
    rng = np.random.default_rng(0)

    print(
        f"block {block_bytes // 1024} KiB ({args.dtype}, {args.block_size} tokens); "
        "GB/s = median; x = median per-repetition ratio pull / raw-1"
    )
    print(
        f"{'size':>6} {'pattern':>10} {'blocks':>6} {'descs':>5} {'raw-1':>7} {'pull':>7} "
        f"{'read':>7} {'read+v':>7} {'x':>5} {'v/r':>5}"
    )
    # Warm the event loop, its executor thread and the peer connection before measuring.
    parent.send_bytes(msgpack.packb({"blocks": [0]}))
    warm = kv_pb2.KvHandle.FromString(parent.recv_bytes())
    plan = reader.allocator.plan_import(None, args.block_size, args.block_size)
    for _ in range(50):
        loop.run_until_complete(
            pull(agent, reader, warm, plan, timeout_s=60, on_orphan=print, on_quarantine=print)
        )
    reader.allocator.abort_import(plan)
    for size_mib in args.sizes_mib:
        n = size_mib * MIB // block_bytes
        nbytes = n * block_bytes
        patterns = {
            "contiguous": list(range(n)),
            "alternate": list(range(0, 2 * n, 2)),
            "random": rng.permutation(holder_blocks)[:n].tolist(),
        }
        for name, ids in patterns.items():
            parent.send_bytes(msgpack.packb({"blocks": ids}))
            handle = kv_pb2.KvHandle.FromString(parent.recv_bytes())
            plan = reader.allocator.plan_import(None, n * args.block_size, n * args.block_size)
            peer = agent.add_peer(handle.agent_metadata)
            remote = [(handle.blocks[i].address, block_bytes) for i in plan.pull]
            local = [reader.kv.block_address(plan.blocks[i]) for i in plan.pull]
            one_remote, one_local = (holder_base, nbytes), (reader.kv.buffer.data_ptr(), nbytes)
            stats: list[Any] = []

            def decode_pull(plan: ImportPlan = plan, handle: kv_pb2.KvHandle = handle) -> None:
                coro = pull(
                    agent,
                    reader,
                    handle,
                    plan,
                    timeout_s=60,
                    on_orphan=lambda: None,
                    on_quarantine=print,
                )
                pulled = loop.run_until_complete(coro)
                if pulled.mismatched:
                    raise RuntimeError(f"blocks {pulled.mismatched} failed their digests")
                stats.append(pulled.stats)  # noqa: B023

            def read_verify(plan: ImportPlan = plan, handle: kv_pb2.KvHandle = handle) -> None:
                agent.read(peer, remote, local, timeout_s=60)  # noqa: B023
                got = cache_block_digests(reader.kv, [plan.blocks[i] for i in plan.pull])
                if got != [handle.block_digests[i] for i in plan.pull]:
                    raise RuntimeError("pulled blocks do not match the holder's digests")

            times = measure(
                {
                    "raw-1": functools.partial(raw_read, agent, peer, one_remote, one_local),
                    "read": functools.partial(agent.read, peer, remote, local, timeout_s=60),
                    "read+v": read_verify,
                    "pull": decode_pull,
                },
                args.reps,
            )
            got = reader.kv.buffer.view(-1).view(torch.uint8).view(max_blocks, -1)
            want = torch.tensor([b % 251 for b in ids], dtype=torch.uint8)
            assert torch.equal(got[plan.blocks[:n], 0], want), "pulled bytes are wrong"
            reader.allocator.abort_import(plan)
            # Fresh: blocks 0, 1, ... again.
            reader.allocator = KvAllocator.create(
                max_blocks, args.block_size, reader.allocator.root
            )
            gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            ratio = statistics.median(
                r / p for r, p in zip(times["raw-1"], times["pull"], strict=True)
            )
            verify = statistics.median(
                v / r for v, r in zip(times["read+v"], times["read"], strict=True)
            )
            print(
                f"{size_mib:>4}Mi {name:>10} {n:>6} {stats[-1].descriptors:>5} "
                f"{gbps['raw-1']:>7.2f} {gbps['pull']:>7.2f} {gbps['read']:>7.2f} "
                f"{gbps['read+v']:>7.2f} {ratio:>5.2f} {verify:>5.2f}",
                flush=True,
            )

    parent.send_bytes(msgpack.packb(None))
    proc.join(30)
    loop.close()
    agent.close()


if __name__ == "__main__":
    main()
