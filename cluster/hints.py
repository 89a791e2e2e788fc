"""What the `epd` commands suggest when a call to the router fails: where they looked for
the key (UNAUTHENTICATED), or TLS (a router serving TLS closes a plaintext connection); and
what `epd serve` says once a worker waits for Ray resources (`RAY_ASKS_HINT`)."""

from __future__ import annotations

import argparse
from typing import Any

# What sets what a worker asks of Ray: `epd serve` waited its 600 s `ready_timeout_s` on a
# small node, its line naming what a worker asked, not what sets it (newuser review, s41).
RAY_ASKS_HINT = (
    "what each worker asks of Ray: [pools] num_cpus (default: its threads), num_gpus, "
    "memory_mb; its threads: [encoder|prefill|decode] threads (0: share the node's cores)"
)


def failure_hint(args: argparse.Namespace, code: Any, details: str) -> str:
    """What to try, for a call that failed with `code`: the key (UNAUTHENTICATED), or TLS (a
    router serving TLS closes a plaintext connection: "Socket closed")."""
    import grpc

    if code == grpc.StatusCode.UNAUTHENTICATED:
        return _key_hint(args)
    # "" dials plaintext too (as `epd.client` reads an empty $EPD_TLS_CA_FILE); commands
    # without the flag (`serve`, `config`) get no hint to give it.
    plaintext = hasattr(args, "tls_ca_file") and not args.tls_ca_file
    if code == grpc.StatusCode.UNAVAILABLE and "Socket closed" in details and plaintext:
        return " (if the router serves TLS, it closes plaintext connections: give --tls-ca-file)"
    return ""


def _key_hint(args: argparse.Namespace) -> str:
    """Where the command looked for its key, for an UNAUTHENTICATED answer."""
    from common.settings.api_keys import (
        ADMIN_KEY_FILE,
        API_KEY_VAR,
        CLIENT_KEY_FILE,
        NAMESPACE_VAR,
        env_api_key,
        key_file,
    )

    if getattr(args, "api_key", None):
        return " (the key given with --api-key)"
    if env_api_key():
        return f" (the key in ${API_KEY_VAR})"
    path = key_file(CLIENT_KEY_FILE if args.command == "generate" else ADMIN_KEY_FILE)
    if not path.exists():  # "read X" suggested a file that was read (serve writes none
        # when given a keys file)
        return (
            f" (no --api-key or ${API_KEY_VAR}, and no key file at {path}: give --api-key, "
            f"or set ${NAMESPACE_VAR} to another namespace's `epd serve`)"
        )
    return (
        f" (no --api-key or ${API_KEY_VAR}; read {path}: set ${NAMESPACE_VAR} for another "
        "namespace's `epd serve`)"
    )
