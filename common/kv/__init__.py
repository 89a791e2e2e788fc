"""Paged KV state: block pool, block-major cache, block hashing, layout, allocation, events."""
