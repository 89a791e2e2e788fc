"""Worker-to-worker bulk transfer over NIXL: KV blocks and large tensors, pulled by READ.

`TransferAgent` owns this process's NIXL agent; `merge_ranges` coalesces adjacent ranges;
`handle_for` / `read_tensor` convert between tensors and protobuf `TransferHandle`s.
"""

from common.transfer.handles import handle_for, read_tensor
from common.transfer.nixl_agent import (
    DEVICE_MEMORY,
    HOST_MEMORY,
    RegisteredRegion,
    TransferAgent,
    TransferError,
    TransferStats,
    TransferTimeoutError,
    UnknownPeerError,
)
from common.transfer.ranges import ByteRange, RangeArray, Ranges, check_pairs, merge_ranges

__all__ = [
    "DEVICE_MEMORY",
    "HOST_MEMORY",
    "ByteRange",
    "RangeArray",
    "Ranges",
    "RegisteredRegion",
    "TransferAgent",
    "TransferError",
    "TransferStats",
    "TransferTimeoutError",
    "UnknownPeerError",
    "check_pairs",
    "handle_for",
    "merge_ranges",
    "read_tensor",
]
