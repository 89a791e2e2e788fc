"""Protobuf <-> in-process types, at the gRPC edge (the only layer below the servers that
imports the `epd.v1` bindings)."""
