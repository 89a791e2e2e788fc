"""Shared gRPC channels to workers, one per address, with the router's message limits."""

from __future__ import annotations

import logging

import grpc

logger = logging.getLogger(__name__)


class Channels:
    """Lazily opened `grpc.aio` channels keyed by address; `close` closes them all.

    Channels are cheap to keep and reconnect by themselves, so one lives as long as the
    router; `forget` closes the one of a worker that went away.
    """

    def __init__(self, max_message_bytes: int) -> None:
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to `address`, opened on first use."""
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = channel
        return channel

    async def forget(self, address: str) -> None:
        """Close the channel to `address`, if open."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        """Close every channel."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
