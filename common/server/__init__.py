"""gRPC server plumbing shared by every role: rpc, lifecycle, registration, the entry point."""
