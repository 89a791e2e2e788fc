"""The prefill worker's side of the encoder handoff: decode a Prefill request's multimodal
half, pulling the embeddings encoders hold by NIXL, then release those encoder leases.

`EmbeddingPulls.read_handoff` runs `common.handoff.read_handoff` on a worker thread (NIXL
pulls block; this module's own `PULL_THREADS`, as `common.kv_pull`'s: the event loop's
default executor has six threads on a two-core machine, which six stalled encoders would
hold up to the pull timeout, and everything else run there with them) with a resolver
that READs each `TransferHandle` into this worker's device and notes its lease. Once the
pulls are over (also when the request fails, and, for a cancelled request, only once the
thread has finished: NIXL may still be writing), every lease pulled is released on the
encoder `PrefillRequest.embedding_holders` names for it, in the background; a
lease without a holder address is left to expire there.

Errors: what a handle claims is at fault (sizes, metadata NIXL cannot load, a range outside
the holder's registered memory) is INVALID_ARGUMENT naming the field; a holder that cannot
be reached or fails the READ, and bytes READ that do not match the handle's digest (the
lease ran out before the pull and the range holds another output now), are UNAVAILABLE with
`EMBEDDINGS_LOST`: the router encodes the items again. Nothing read is used then.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from common.cpu import torch_thread
from common.handoff import EMBEDDINGS_LOST, Handoff, read_handoff
from common.models.runner import LmRunner
from common.multimodal.validation import MultimodalLayoutError
from common.server.peers import PeerClient
from common.server.rpc import RpcStatusError
from common.transfer.agent import TransferAgent
from common.transfer.types import TransferDigestError, TransferError, TransferRefusedError
from common.wire.convert import torch_dtype
from common.wire.transfer import HandleWithoutDigestError, read_tensor
from epd.v1 import multimodal_pb2, tensor_pb2

logger = logging.getLogger(__name__)

PULL_THREADS = 32  # handoffs being read at once, per process (each mostly waits on encoders)
_pulls = ThreadPoolExecutor(
    PULL_THREADS, thread_name_prefix="epd-embedding-pull", initializer=torch_thread
)


class EmbeddingPulls:
    """Pulls of encoder-held embeddings for one prefill worker (see the module docstring)."""

    def __init__(
        self, runner: LmRunner, agent: TransferAgent, peers: PeerClient, timeout_s: float
    ) -> None:
        self.runner = runner
        self.agent = agent  # this worker's NIXL agent (the READ side)
        self.peers = peers  # releases to encoders
        self.timeout_s = timeout_s  # longest pull of one embedding tensor
        # Tensors READ whose bytes were not those the encoder lent (refused; encoded again).
        self.digest_failures = 0
        self._lock = threading.Lock()  # counts from the pull threads

    async def read_handoff(
        self,
        tokens: Sequence[int],
        multimodal: multimodal_pb2.MultimodalParams,
        holders: Mapping[str, str],
        time_left_s: float | None,
    ) -> Handoff:
        """The checked handoff with its embeddings, pulled; releases what was pulled."""
        pulled: list[str] = []  # embedding leases pulled from encoders
        # One deadline for its pulls, from now: one that waited for a thread has that much
        # less, and one whose request is gone never starts (ownfix review).
        deadline = time.monotonic() + max(min(self.timeout_s, time_left_s or math.inf), 1e-3)
        work = _pulls.submit(
            read_handoff,
            self.runner,
            tokens,
            multimodal,
            with_embeddings=True,
            resolve=functools.partial(self._resolve, pulled=pulled, deadline=deadline),
        )
        decoding = asyncio.wrap_future(work)
        try:
            return await asyncio.shield(decoding)
        finally:
            if decoding.done() or work.cancel():  # over, or never started
                self._release(pulled, holders)
            else:  # cancelled while pulls run: release the leases once they are over

                def over(pulls: asyncio.Future[Handoff]) -> None:
                    if not pulls.cancelled():
                        pulls.exception()  # retrieved: nobody waits for it any more
                    self._release(pulled, holders)

                decoding.add_done_callback(over)

    def _resolve(
        self, ref: tensor_pb2.TensorRef, field: str, *, pulled: list[str], deadline: float
    ) -> torch.Tensor:
        """Pull an embedding held by a NIXL handle by `deadline` (`time.monotonic()`; worker
        thread); note its lease."""
        dtype = torch_dtype(ref.dtype, field)
        timeout_s = deadline - time.monotonic()
        if timeout_s <= 0:
            raise RpcStatusError(
                grpc.StatusCode.UNAVAILABLE, f"{field}: {EMBEDDINGS_LOST} (no time left to pull it)"
            )
        try:
            tensor = read_tensor(
                ref.handle,
                dtype,
                [int(d) for d in ref.shape],
                self.agent,
                device=self.runner.device,
                timeout_s=timeout_s,
            )
        except TransferRefusedError as exc:
            raise MultimodalLayoutError(field, f"cannot pull embeddings: {exc}") from None
        except HandleWithoutDigestError:  # the deployment's doing, not the caller's
            # INTERNAL: FAILED_PRECONDITION would have the router send the items again and
            # HTTP clients a 400 (ownfix review B).
            raise RpcStatusError(
                grpc.StatusCode.INTERNAL,
                f"{field}: the encoder that lent it sent no digest of the bytes (a version "
                "from before this prefill worker's floor): upgrade encoders before prefill "
                "workers (docs/compatibility.md)",
            ) from None
        except TransferDigestError as exc:
            with self._lock:
                self.digest_failures += 1
            raise RpcStatusError(
                grpc.StatusCode.UNAVAILABLE,
                f"{field}: {EMBEDDINGS_LOST} (the bytes READ were not those lent: {exc})",
            ) from None
        except TransferError as exc:
            raise RpcStatusError(
                grpc.StatusCode.UNAVAILABLE, f"{field}: {EMBEDDINGS_LOST} ({exc})"
            ) from None
        except ValueError as exc:
            raise MultimodalLayoutError(field, str(exc)) from None
        except Exception as exc:
            if not type(exc).__name__.startswith("nixl"):  # e.g. nixlRemoteDisconnectError
                raise
            raise RpcStatusError(
                grpc.StatusCode.UNAVAILABLE, f"{field}: {EMBEDDINGS_LOST} ({exc!r})"
            ) from None
        if ref.handle.lease_id and ref.handle.lease_id not in pulled:
            pulled.append(ref.handle.lease_id)
        return tensor

    def _release(self, lease_ids: list[str], holders: Mapping[str, str]) -> None:
        """Release each pulled lease on its encoder, once, in the background."""
        known: dict[str, str] = {}
        for lease_id in lease_ids:
            address = holders.get(lease_id)
            if address:
                known[lease_id] = address
            else:
                logger.debug("embedding lease %s has no holder address; it will expire", lease_id)
        self.peers.release_embeddings(known)
