"""Registered memory: the region record, which NIXL segment a tensor lives in, and mapping a
read's local ranges onto the registered regions (NIXL refuses descriptors outside them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from common.transfer.ranges import ByteRange, RangeArray
from common.transfer.types import DEVICE_MEMORY, HOST_MEMORY


@dataclass(frozen=True, slots=True)
class RegisteredRegion:
    """A memory range registered with this process's NIXL agent."""

    # Start address in this process.
    address: int
    # Length in bytes.
    nbytes: int
    # NIXL segment: "DRAM" (host) or "VRAM" (device).
    memory: str
    # CUDA device ordinal for device memory; 0 for host memory.
    device_id: int
    # The registered tensor, held so its memory outlives the registration.
    tensor: torch.Tensor = field(repr=False, compare=False)
    # NIXL's registration list, needed to deregister.
    _reg_descs: Any = field(repr=False, compare=False)

    def contains(self, address: int, nbytes: int) -> bool:
        """True if [address, address + nbytes) lies inside this region."""
        return self.address <= address and address + nbytes <= self.address + self.nbytes


def tensor_memory(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL segment name and device ordinal for a tensor's storage."""
    if tensor.device.type == "cpu":
        return HOST_MEMORY, 0
    if tensor.device.type == "cuda":
        return DEVICE_MEMORY, tensor.device.index or 0
    raise ValueError(f"NIXL cannot register memory on device {tensor.device}")


def local_regions_small(
    regions: Sequence[RegisteredRegion], local: list[ByteRange], agent_name: str
) -> tuple[list[int], str, int]:
    """`local_regions_of` in plain Python for a few ranges."""
    ids: list[int] = []
    for i, (address, nbytes) in enumerate(local):
        for j, region in enumerate(regions):
            if region.contains(address, nbytes):
                ids.append(j)
                break
        else:
            raise ValueError(
                f"local range {i} ({address:#x}+{nbytes}) is not inside memory registered "
                f"with {agent_name}; register the destination buffer first"
            )
    kinds = {(regions[j].memory, regions[j].device_id) for j in set(ids)}
    if len(kinds) != 1:
        raise ValueError(f"local ranges span several memories {sorted(kinds)}; split the read")
    memory, device = kinds.pop()
    return ids, memory, device


def local_regions_of(
    regions: Sequence[RegisteredRegion], local: RangeArray, agent_name: str
) -> tuple[npt.NDArray[np.int64], str, int]:
    """Index of the registered region holding each local range, plus the segment and
    device they share. Raises ValueError if a range is unregistered or they mix memories.
    """
    if not regions:
        raise ValueError(
            f"no memory is registered with {agent_name}; register the destination buffer first"
        )
    by_start = sorted(range(len(regions)), key=lambda i: regions[i].address)
    starts = np.array([regions[i].address for i in by_start], dtype=np.int64)
    ends = starts + np.array([regions[i].nbytes for i in by_start], dtype=np.int64)
    # Regions never overlap, so the candidate is the last one starting at or below.
    idx = np.searchsorted(starts, local[:, 0], side="right") - 1
    inside = (idx >= 0) & (local[:, 0] + local[:, 1] <= ends[np.maximum(idx, 0)])
    bad = np.flatnonzero(~inside)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"local range {i} ({local[i, 0]:#x}+{local[i, 1]}) is not inside memory "
            f"registered with {agent_name}; register the destination buffer first"
        )
    kinds = {
        (regions[by_start[i]].memory, regions[by_start[i]].device_id)
        for i in np.unique(idx).tolist()
    }
    if len(kinds) != 1:
        raise ValueError(f"local ranges span several memories {sorted(kinds)}; split the read")
    memory, device = kinds.pop()
    return idx.astype(np.int64), memory, device


def desc_array(ranges: RangeArray, device_id: int) -> npt.NDArray[np.uint64]:
    """Nx3 uint64 (address, length, device) rows: NIXL's fastest descriptor-list input."""
    arr = np.empty((len(ranges), 3), dtype=np.uint64)
    arr[:, :2] = ranges
    arr[:, 2] = device_id
    return arr


def registered_region(
    regions: list[RegisteredRegion], memory: str, device_id: int, address: int, nbytes: int
) -> RegisteredRegion | None:
    """The region already holding `[address, address + nbytes)`, or None when none overlaps
    it; ValueError when it overlaps a region without lying inside it."""
    for region in regions:
        if region.memory != memory or region.device_id != device_id:
            continue
        if region.contains(address, nbytes):
            return region
        if address < region.address + region.nbytes and region.address < address + nbytes:
            raise ValueError(
                f"tensor at {address:#x}+{nbytes} overlaps registered region "
                f"{region.address:#x}+{region.nbytes}"
            )
    return None
