"""The decode worker: verifies a prefill worker's KV handle against the handoff, pulls the
blocks it lacks by NIXL READ, and streams tokens with continuous batching
(`python -m decode_worker`, `decode_worker.server.serve`)."""
