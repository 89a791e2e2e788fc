"""`host:port` addresses as workers register them and peers dial them.

An IPv6 host is written in brackets (`[fd00::1]:50062`). A worker's own address made of a
bare IPv6 host and a port (`$(POD_IP):50062` on an IPv6 pod gives `fd00::1:50062`) is put in
brackets (`bracketed`); the registry refuses any other form it cannot dial (`check_address`).
Errors a client reads name no address (`without_addresses`).
"""

from __future__ import annotations

import ipaddress
import re

# An address in a message, as gRPC and our workers write them: gRPC's own forms
# (`ipv4:10.0.0.5:50062`, `ipv6:%5B::1%5D:1`, `dns:host:port`), a bracketed IPv6 address, a
# bare one with `::`, an IPv4 address, or a dotted host name with a port. Not any word before
# `:digits` (a time, a ratio, `id:12345` are a client's own words).
_ADDRESS = re.compile(
    r"(?:ipv4|ipv6|dns|unix|unix-abstract):(?:\[[^\]\s]*\]|%5B\S*?%5D|[^\s:]+)(?::\d{1,5})?"
    r"|\[[0-9A-Fa-f.%]*:[0-9A-Fa-f:.%]*\](?::\d{1,5})?"
    r"|(?<![\w:.])[0-9A-Fa-f:]*::[0-9A-Fa-f:.]*[0-9A-Fa-f]"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"
    r"|\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+:\d{1,5}\b"
)


def bracketed(address: str) -> str:
    """`address` with a bare IPv6 host put in brackets: `fd00::1:50062` -> `[fd00::1]:50062`;
    any other address as it is."""
    host, sep, port = address.rpartition(":")
    if sep and ":" in host and not host.startswith("[") and port.isdigit():
        try:
            ipaddress.IPv6Address(host)
        except ValueError:  # `fd00::1` alone is no host and port: left for the check
            return address
        return f"[{host}]:{port}"
    return address


def check_address(address: str, field: str = "worker.address") -> None:
    """ValueError naming `field` unless `address` is host:port ([v6]:port) with a port in
    1..65535 and a host free of spaces, slashes and other URL syntax."""
    if not address:
        raise ValueError(f"{field} is empty")
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        bad_host = not host or any(c not in "0123456789abcdefABCDEF:." for c in host)
    else:
        bad_host = not host or any(c.isspace() or c in "/@?#[]:\\" for c in host)
    if not sep or bad_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: {address!r} is not an address (host:port, port 1-65535)")


def without_addresses(text: str, instead: str = "a worker") -> str:
    """`text` with every network address in it replaced by `instead`: what a worker's or
    gRPC's error says, for a client (the addresses are the operator's to know)."""
    return _ADDRESS.sub(instead, text)
