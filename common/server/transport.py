"""The gRPC transport options of every epd server and channel (`common.server.rpc` applies
them): message sizes, keepalive, the connections a server keeps, reconnects.

Keepalive: a call whose peer stops answering (a frozen process, a lost network path; a
killed process resets its connections at once) fails with UNAVAILABLE once an HTTP/2 ping
sent after `KEEPALIVE_S` of the call goes unanswered for `KEEPALIVE_S` more, so that the
caller tries another peer (`router.calls`) instead of waiting out the call's deadline. A
new connection to such a process (its kernel accepts it, nobody speaks) fails its calls
after as long (`connect_options`).
Pings are sent only while calls are open. Every epd server accepts them (any interval:
gRPC's default answers a third ping within 5 minutes without data with GOAWAY
"too_many_pings", which would end a long call).

Connections: a connection needs no credentials (those are per call) and each is a file
descriptor: 120 silent ones took down a router at 128 descriptors, its health, metrics and
workers' heartbeats included. A server gives each connection `HANDSHAKE_S` to finish its
handshake, and its process's soft limit on open files is raised to the hard one
(`common.server.role`), so silent connections must number in the tens of thousands.
`max_connections` caps them (0, the default: no cap): a cap keeps the descriptors, but one
source that holds that many connections (a handshake, then nothing) shuts every other
client, worker and probe out of the port, so it is for a process whose file limit cannot be
raised. Limiting each source is the network's job in front (a load balancer's or
firewall's limit per source). No idle connection is closed: a server's idle close raced
calls starting as it closed, which failed or hung to their deadlines (own-fix review).

Reconnects: a channel tries to reconnect to a peer that went away at least every
`RECONNECT_MAX_S` (gRPC's own back-off grows to 120 s: a router down a few minutes got its
workers back, and a client its answers, up to two minutes after it was serving again).
"""

from __future__ import annotations

DEFAULT_MAX_MESSAGE_MB = 256
KEEPALIVE_S = 10.0
HANDSHAKE_S = 10.0  # a connection's time to finish its handshake (silent ones held ~60 s)
# A channel's waits between attempts to reconnect to a peer that went away: the first, and
# the longest (a connection attempt a second to a dead peer costs little).
RECONNECT_FIRST_S = 0.25
RECONNECT_MAX_S = 1.0
CONNECT_MIN_S = 1.0  # the least a connection has to finish its handshake (TLS on a busy host)

Options = list[tuple[str, int]]


def message_options(max_message_mb: int = DEFAULT_MAX_MESSAGE_MB) -> Options:
    """Both ends: message size limits in both directions."""
    limit = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]


def keepalive_options(keepalive_s: float = KEEPALIVE_S) -> Options:
    """Both ends: ping the peer every `keepalive_s` while calls are open, data or not, and
    fail those calls (UNAVAILABLE) when a ping goes unanswered that long."""
    ms = max(1, round(keepalive_s * 1000))
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),  # gRPC >= 1.6x enforces this one, not the above
        ("grpc.http2.max_pings_without_data", 0),  # else pings stop after 2 without data
    ]


def connect_options(keepalive_s: float = KEEPALIVE_S) -> Options:
    """A channel's pings (`keepalive_options`), and a connection's time to finish its
    handshake: twice `keepalive_s` (what a ping has to be answered, twice), at least
    `CONNECT_MIN_S`. A peer that accepts connections and never speaks (a frozen process: its
    kernel accepts for it) fails a call as a silent one on an open connection does; gRPC's
    own limit is 20 s whatever the keepalive (its `min_reconnect_backoff_ms` is that
    limit)."""
    connect_s = max(CONNECT_MIN_S, 2 * keepalive_s)
    return [
        *keepalive_options(keepalive_s),
        ("grpc.min_reconnect_backoff_ms", round(connect_s * 1000)),
    ]


def server_options(
    max_message_mb: int,
    keepalive_s: float,
    max_connections: int = 0,
    stream_window_bytes: int | None = None,
) -> Options:
    """A server's: the above, the connection bounds (module docstring; `max_connections`
    0: no cap), and `stream_window_bytes` as each call's fixed receive window (None:
    gRPC's own, grown by bandwidth probing)."""
    options = [
        *message_options(max_message_mb),
        *keepalive_options(keepalive_s),  # a frozen client's calls end, not at their deadline
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),  # pings at any interval
        ("grpc.http2.max_ping_strikes", 0),  # 0: never too many
        ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ("grpc.server_handshake_timeout_ms", round(HANDSHAKE_S * 1000)),
    ]
    if max_connections:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    if stream_window_bytes is not None:
        options.append(("grpc.http2.bdp_probe", 0))
        options.append(("grpc.http2.lookahead_bytes", stream_window_bytes))
    return options


def channel_options(max_message_mb: int, keepalive_s: float | None) -> Options:
    """A channel's: the above (`keepalive_s` None: no pings), its own connections (a local
    subchannel pool: a channel opened anew to a process that restarted at the same address
    must not inherit the dead connection's back-off from gRPC's process-wide pool), and the
    reconnect back-off (module docstring)."""
    return [
        *message_options(max_message_mb),
        *(connect_options(keepalive_s) if keepalive_s is not None else ()),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", round(RECONNECT_FIRST_S * 1000)),
        ("grpc.max_reconnect_backoff_ms", round(RECONNECT_MAX_S * 1000)),
    ]
