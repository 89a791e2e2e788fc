"""A checkpoint's identity, and loading weights under the identity of the bytes loaded.

`model_identity` is `qwen3-vl/<digest>`: SHA-256 of the canonical config, of which file
each tensor is read from, and of every weight file's name and bytes. Identical on every
machine holding the same checkpoint; the router refuses a worker whose identity is not its
own, and block hashes are rooted in it (DESIGN §3), so a worker must never report an
identity other than that of the weights it computes with.

`load_identified` loads and identifies together: it stats every file the identity covers
before the load and after the hash, and refuses to start when any changed (a checkpoint
replaced or rewritten while it was loaded gave a worker the new identity with the old
weights). The loaded tensors own their bytes (`load_weights` copies), so the files may
change afterwards without effect.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from common.errors import CheckpointError
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.weights import (
    INDEX_FILE,
    load_weights,
    weight_files,
)

_DIGEST_CHUNK = 8 << 20
CONFIG_FILE = "config.json"


def model_identity(path: str | Path, config: Qwen3VLConfig) -> str:
    """`qwen3-vl/<digest>` of the checkpoint at `path` (module docstring). Reads each weight
    file once (about a second per GB); done once per process start."""
    files = weight_files(path)
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    if _copies_elsewhere(files):
        # Which file each tensor comes from, when the bytes do not say: a shard holds a
        # second copy of a tensor the index maps elsewhere, and two indexes over the same
        # shards are two models. (Not otherwise: every other checkpoint keeps its identity.)
        digest.update(json.dumps(sorted((n, file.name) for n, file in files.items())).encode())
    for file in sorted(set(files.values())):
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(_DIGEST_CHUNK):
                digest.update(chunk)
    return f"qwen3-vl/{digest.hexdigest()[:32]}"


def _copies_elsewhere(files: dict[str, Path]) -> bool:
    """Whether a shard holds a tensor the index reads from another shard (headers only)."""
    for file in set(files.values()):
        with safe_open(str(file), framework="pt") as f:
            if any(files.get(name, file) != file for name in f.keys()):  # noqa: SIM118
                return True
    return False


def file_stamps(path: str | Path) -> list[tuple[str, int, int, int, int, int]]:
    """(name, device, inode, size, mtime ns, ctime ns) of the config, the index and every
    weight file, symlinks followed (a Hugging Face snapshot links its files into a blob
    store)."""
    folder = Path(path)
    files = sorted({folder / CONFIG_FILE, *weight_files(folder).values()})
    if (folder / INDEX_FILE).is_file():
        files.append(folder / INDEX_FILE)
    stamps = []
    for file in files:
        st = os.stat(file)
        # ctime too: the kernel sets it on every write, and a copy may put the mtime back.
        stamps.append((file.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return stamps


def load_identified(
    path: str | Path, config: Qwen3VLConfig, **load: Any
) -> tuple[dict[str, torch.Tensor], str]:
    """`load_weights(path, config, **load)` and `model_identity(path, config)`, raising
    `CheckpointError` when a file they cover changed meanwhile (module docstring)."""
    before = file_stamps(path)
    tensors = load_weights(path, config, **load)
    identity = model_identity(path, config)
    if file_stamps(path) != before:
        raise CheckpointError(
            f"checkpoint {path} changed while it was loaded (a file was replaced or "
            "rewritten): start again once it is complete"
        )
    return tensors, identity
