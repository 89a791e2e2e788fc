"""The encoder worker: runs the vision tower behind EncoderService, with an encoder cache.

`server.serve(EncoderSettings(...))` starts one in-process; `python -m encoder_worker`
runs one as a process. See `server` for the lifecycle.
"""
