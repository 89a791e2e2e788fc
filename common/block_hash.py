"""Public home of the block-hash functions (defined in `common.kv.hashing`)."""

from common.kv.hashing import MmKey, block_extra_keys, block_hashes

__all__ = ["MmKey", "block_extra_keys", "block_hashes"]
