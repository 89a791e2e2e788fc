"""The prefill worker: computes a prompt's KV and first token, then lends the KV to a decode
worker by NIXL READ under a lease (`python -m prefill_worker`, `prefill_worker.server.serve`)."""
