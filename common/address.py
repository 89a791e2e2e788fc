"""`host:port` addresses as workers register them and peers dial them.

An IPv6 host is written in brackets (`[fd00::1]:50062`). A worker's own address made of a
bare IPv6 host and a port (`$(POD_IP):50062` on an IPv6 pod gives `fd00::1:50062`) is put in
brackets (`bracketed`); the registry refuses any other form it cannot dial (`check_address`).
Errors a client reads name no address (`without_addresses`, and `without_known` for the
addresses a router knows its workers by, whatever their form).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection

# An address in a message, as gRPC, the OS and our workers write them (each candidate is
# checked in `_address`): gRPC's own forms (`ipv4:10.0.0.5:50062`, `ipv6:%5B::1%5D:1`,
# `dns:host:port`, `dns:///[fd00::1]:1`), a DNS error's `name=`, a bracketed IPv6 address
# with its port, a bare IPv6 one (with `::`, or all 8 groups; a zone), an IPv4 one (a
# Python `('10.0.0.5', 50062)` whole), `localhost`, a dotted host name with a letter in it
# (`10-0-0-5.ns.pod.cluster.local`, `gpu_node.local`) or a hyphenated one led by a letter,
# with a port. Not any word before `:digits`: a time (`2024-05-01T10:00`), a ratio,
# `id:12345`, `c10::Error`, `version 2.35:1`, `file.cpp:44` are a client's or a library's.
# (Tried from each of a name's parts, a run of `a-` costs its length squared: ~10 ms at the
# 1 KiB a worker's error details are clipped to, `common.server.rpc.MAX_DETAILS`.)
_ADDRESS = re.compile(
    r"(?P<grpc>(?:ipv4|ipv6|dns|unix|unix-abstract):/*"
    r"(?:\[[^\]\s]*\]|%5B\S*?%5D|[^\s:]+)(?::\d{1,5})?)"
    r"|(?P<dns>name=[^\s]+)"
    r"|(?P<bracket>\[[0-9A-Fa-f.:]+(?:%[\w.-]+)?\]:\d{1,5})"
    r"|(?P<tuple>\('[0-9A-Fa-f.:]+',\s*\d{1,5}\))"
    r"|(?P<v6>(?<![\w:.\[])(?:[0-9A-Fa-f:]*::[0-9A-Fa-f:.]*[0-9A-Fa-f]|(?:[0-9A-Fa-f]{1,4}:){7}"
    r"[0-9A-Fa-f]{1,4}(?::\d{1,5})?)(?:%[\w.-]+)?(?![\w:]))"
    r"|(?P<v4>\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b)"
    r"|(?P<host>\b(?:localhost|(?=[\w.-]*[A-Za-z])\w[\w-]*(?:\.[\w-]+)+\.?|[A-Za-z]\w*(?:-\w+)+)"
    r":\d{1,5}\b)"
)
# Source files in a library's error (`CUDAException.cpp:44`), not hosts.
_FILE_SUFFIXES = frozenset(
    {"c", "cc", "cpp", "cu", "h", "hpp", "json", "proto", "py", "pyx", "rs", "safetensors", "so"}
    | {"toml", "txt", "yaml", "yml"}
)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _address(match: re.Match[str], instead: str) -> str:
    """`instead` for a candidate that is an address, the text as it is otherwise."""
    text, kind = match.group(0), match.lastgroup
    if kind == "bracket":
        keep = not _is_ip(text[1 : text.rindex("]")])
    elif kind == "tuple":
        keep = not _is_ip(text.split("'")[1])
    elif kind == "v6":  # with its port, or without
        host, _, port = text.rpartition(":")
        keep = not (_is_ip(text) or (port.isdigit() and _is_ip(host)))
    elif kind == "v4":
        keep = not _is_ip(text.split(":")[0])
    elif kind == "host":
        keep = text.rsplit(":", 1)[0].rsplit(".", 1)[-1].lower() in _FILE_SUFFIXES
    else:
        keep = False
    return text if keep else instead


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
    return _ADDRESS.sub(lambda match: _address(match, instead), text)


# A `host:port` (`[v6]:port`) standing alone: not inside a longer name (`x.vm:1`, `x-vm:1`)
# or port, after `...` or a dash, before a dash, a sentence's end or in a URL too, in gRPC's
# `ipv4:`, `ipv6:` and `dns:` forms as well (group 1: the address); `vm:1.5` is a number. A
# registered address is of the plain form but where its host has other characters.
_ALONE = r"(?<!\w)(?<!\w[.-])(?:ipv4:|ipv6:|dns:(?:///)?)?({})(?!\w|\.\d|:\d)"
_PLAIN = r"\[[0-9A-Fa-f.:]+(?:%[\w.-]+)?\]:\d{1,5}|\w[\w-]*(?:\.[\w-]+)*\.?:\d{1,5}"
_ANY_PLAIN = re.compile(_ALONE.format(_PLAIN))
_PLAIN_ADDRESS = re.compile(_PLAIN)


def without_known(text: str, addresses: Collection[str], instead: str = "a worker") -> str:
    """`text` with each of `addresses` replaced by `instead` where it stands alone (`_ALONE`):
    the addresses a router knows its workers by, which `without_addresses` misses where a
    host is one plain word (`vm:50062`, `gpu01:50062`: a client's `id:12345` looks the
    same). One pass over `text`, whatever the number of addresses (an address of another
    form, rare, costs a pass of its own)."""
    known = set(addresses)
    if not known:
        return text
    # Those of another form first: one may end with a plain one (`a+b:1`, `b:1`).
    other = [a for a in known if not _PLAIN_ADDRESS.fullmatch(a) and a in text]
    for address in sorted(other, key=len, reverse=True):
        text = re.sub(_ALONE.format(re.escape(address)), instead, text)
    return _ANY_PLAIN.sub(lambda m: instead if m[1] in known else m[0], text)
