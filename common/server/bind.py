"""Why a server cannot listen where its settings say: gRPC answers only "Failed to bind",
so a plain socket bind asks the system, and the message names the setting to change."""

from __future__ import annotations

import errno
import socket


def bind_problem(host: str, port: int) -> str | None:
    """Why a TCP server could not listen on `host:port` now: "in use", another OSError's
    text, or None when a plain bind succeeds (the port is not reserved by it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host.strip("[]"), port))
    except OSError as exc:
        return "in use" if exc.errno == errno.EADDRINUSE else str(exc.strerror or exc)
    return None


def bind_error(name: str, host: str, port: int) -> str:
    """One line saying why `host:port` cannot be bound, naming the `port` setting."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    problem = bind_problem(host, port)  # grpc does not say why; a plain bind does
    if problem == "in use":
        return f"{name} port {shown} is in use; set `port` to a free one (0: any free port)"
    why = f"cannot be bound ({problem})" if problem else "cannot be bound"
    return f"{name} port {shown} {why}; check `host` and `port`"
