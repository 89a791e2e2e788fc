"""What a block hash is rooted in: the model identity and the KV layout of a worker.

Router, prefill and decode workers all derive a worker's root hash with `layout_root`, so
equal models and layouts give equal block hashes, and different ones never share a block.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgpack

from common.kv.hashing import root_hash
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.weights import weight_files
from epd.v1 import kv_pb2

_DIGEST_CHUNK = 8 << 20


def model_identity(path: str | Path, config: Qwen3VLConfig) -> str:
    """`qwen3-vl/<digest>`: SHA-256 of the canonical config and every weight file's bytes.

    Identical on every machine holding the same checkpoint. Reads each weight file once
    (about a second per GB); done once per worker start.
    """
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    for file in sorted(set(weight_files(path).values())):
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(_DIGEST_CHUNK):
                digest.update(chunk)
    return f"qwen3-vl/{digest.hexdigest()[:32]}"


def layout_root(layout: kv_pb2.KvLayout) -> bytes:
    """Root block hash of a worker's `KvLayout`: its model identity plus every field that
    decides the bytes of a block (not `block_bytes`, which follows from them).

    Router, prefill and decode all derive the root this way, so equal layouts give equal
    hashes and different models or layouts never share a block.
    """
    key = msgpack.packb(
        [
            layout.layout,
            int(layout.dtype),
            layout.block_size,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
        ],
        use_bin_type=True,
    )
    return root_hash(layout.model, key.hex())
