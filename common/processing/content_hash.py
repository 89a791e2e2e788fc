"""Item and partition content hashes: the one function the processor and the encoder share.

A content hash is 32 bytes of BLAKE2b over a domain tag, the processor settings'
fingerprint, the modality, the patch grid, the patch rows' dtype and shape, and the rows'
bytes (DESIGN §2). The router's processor computes it while preprocessing; the encoder
worker computes it again from the patch rows it is asked to encode and never trusts the
caller's (DESIGN §7), so both must derive it from the same settings: `processor_settings`
reads them from a checkpoint folder the way `Processor.from_pretrained` does.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.preprocessor import ProcessorSettings
from common.models.qwen3_vl.processor_files import read_processor_settings

# Domain tag of item and partition content hashes; bump it if the hashed layout changes.
_HASH_TAG = b"epd.qwen3vl.item.v1"


def processor_settings(folder: str | Path, config: Qwen3VLConfig) -> ProcessorSettings:
    """The checkpoint's processor settings: its preprocessor, video preprocessor and
    processor files over defaults from its vision config
    (`common.models.qwen3_vl.processor_files`)."""
    return read_processor_settings(folder, config)


@functools.lru_cache(maxsize=4096)  # a few grids and shapes recur; json costs more than hashing
def _header(modality: str, grid: tuple[int, ...], dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    return json.dumps(
        {"modality": modality, "grid_thw": list(grid), "dtype": str(dtype), "shape": list(shape)},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def content_hash(
    fingerprint: bytes,
    modality: str,
    patches: npt.NDArray[np.float32] | torch.Tensor,
    grid: tuple[int, int, int],
) -> bytes:
    """32-byte BLAKE2b over `fingerprint` (`ProcessorSettings.fingerprint()`), modality,
    grid, dtype, shape and the patch bytes. A tensor is hashed as the float32 rows it holds
    (the processor's dtype), so the encoder's hash of what it received equals the
    processor's hash of what it sent."""
    if isinstance(patches, torch.Tensor):
        if patches.dtype != torch.float32 or patches.device.type != "cpu":
            patches = patches.to("cpu", torch.float32)
        patches = patches.detach().numpy()  # contiguous or not: made contiguous below
    header = _header(str(modality), tuple(int(g) for g in grid), patches.dtype, patches.shape)
    h = hashlib.blake2b(digest_size=32)
    for chunk in (_HASH_TAG, fingerprint, header):
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
    h.update(np.ascontiguousarray(patches).data)
    return h.digest()
