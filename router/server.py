"""The router process: `RouterService.Generate` plus the registry and admin services.

`serve(settings)` loads the checkpoint's processor (tokenizer, media preprocessing), derives
the model identity and KV shape workers must match, and starts one gRPC server with
RouterService, RegistryService, AdminService and grpc.health.v1.

Generate, per request:
  1. check the request (its bytes first: `router.request_bytes`) and process the chat in a
     worker thread; anything malformed -> INVALID_ARGUMENT naming the field, no worker called;
  2. deadline = the client's, capped by `request_timeout_s`;
  3. `Orchestrator.run` streams the answer (encode -> prefill -> decode).

Every call is authenticated (`common.server.auth`): Generate needs a client API key (its
tenant salts the caches: `router.tenants`), RegistryService the cluster bearer, AdminService
an admin key; `--insecure` turns that off (said in the log).

Workers register with every router they are given; each keeps its own registry, KV event
subscriptions and admission ledger (a worker's new process drops its old one's: a restart).

Lifecycle (`common.server.role.RoleServer`): starting (processor loaded) -> serving (`serve`
returned) -> draining (`drain()`: Generate refuses new requests with UNAVAILABLE, running
ones finish, or end saying why: `router.stopping`) -> stopped (`stop`: gRPC, the expiry
task, the orchestrator's KV event subscriptions, the peer client: releases finish).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.errors import FieldError
from common.models.identity import model_identity
from common.models.qwen3_vl.weights import check_checkpoint
from common.processing.content_hash import settings_digest
from common.processing.image_cache import StagedImages
from common.processing.processor import ProcessedPrompt, Processor
from common.roles import KV_ROLES
from common.sampling import SamplingParams
from common.server.auth import Authenticator, Caller, principal, service_credentials
from common.server.lifecycle import ServerLifecycle
from common.server.peers import PeerClient
from common.server.role import AddServicer, RoleServer, checkpoint_path
from common.server.rpc import RpcStatusError, service_name
from epd.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    registry_service_pb2,
    registry_service_pb2_grpc,
    router_service_pb2,
    router_service_pb2_grpc,
)
from router.admin import AdminServicer, Scaler
from router.admission_need import fitted_to_decode
from router.calls import Job, RouterError, invalid, raise_told, told
from router.decode import check_resume
from router.departures import expire_loop, forget_restarted
from router.detokenize import IncrementalDetokenizer
from router.health import health_loop
from router.held import HeldBytes, MediaHold, add_router_service, read_request
from router.ids import check_ids, shown_id
from router.inputs import ContextTooLong, InputError
from router.orchestrator import Orchestrator
from router.outcomes import Outcome, refused_before
from router.prepare import prepare_request
from router.prepare_threads import PrepareThreads, has_media
from router.registry import Registry
from router.registry_service import RegistryServicer
from router.returns import Returns, needed
from router.settings import RouterSettings
from router.stop import check_stop, stop_at
from router.stopping import Stopping
from router.tenants import tenant_salt
from router.workers import CheckpointShape

logger = logging.getLogger(__name__)


class RouterServicer(router_service_pb2_grpc.RouterServiceServicer):
    """`RouterService.Generate`: check, process, orchestrate (see the module docstring)."""

    def __init__(
        self,
        processor: Processor,
        orchestrator: Orchestrator,
        lifecycle: ServerLifecycle,
        settings: RouterSettings,
        *,
        auth: Authenticator | None = None,
        salt_key: bytes | None = None,
    ) -> None:
        self.processor = processor
        self.orchestrator = orchestrator
        self.lifecycle = lifecycle
        self.settings = settings
        self.auth = auth  # who is calling (None: insecure, no tenants)
        self.salt_key = salt_key  # the cluster key tenant salts are derived under
        share = settings.tenant_share_for(auth.client_tenants if auth else 0)
        most, largest = settings.requests_in_flight_mb << 20, settings.max_message_mb << 20
        self.held = HeldBytes(most, largest, tenant_share=share)  # both front doors' requests
        self.stopping = Stopping(lifecycle)  # ends answers once the drain's time ran out
        self.prepare_threads = PrepareThreads(share)  # the threads requests are prepared on
        # Waits for a restarting role's workers (`router.returns`; follows `serve`'s registry).
        self.returns = Returns(
            settings.max_queue_wait_s,
            max_waiting=settings.max_queued_requests,
            stop=lambda: self.lifecycle.draining,
        )

    def _prepare(self, *args: Any) -> tuple[SamplingParams, ProcessedPrompt]:
        """`router.prepare.prepare_request(settings, processor, *args)`, with this router's."""
        return prepare_request(self.settings, self.processor, *args)

    async def generate(
        self,
        request: router_service_pb2.GenerateRequest,
        caller: Caller,
        client_left: float | None,
        holds: int = 0,
        fit_max_tokens: bool = False,
        arrived: float | None = None,
        budget_from: float | None = None,
    ) -> AsyncGenerator[router_service_pb2.GenerateResponse, None]:
        """Stream the answer to one chat for `caller` (its tenant salts the caches) within
        `request_timeout_s` from `budget_from` (None: now) or the client's `client_left` s
        (`Orchestrator.run` says what the chunks hold); media held beside `holds` bytes;
        `fit_max_tokens`: `max_tokens` is the default, cut to the context left; `arrived`:
        TTFT's start. Raises RouterError, or RpcStatusError while draining."""
        request_id = shown_id(request.request_id) or uuid.uuid4().hex  # as logs show it
        started, budget = time.monotonic(), self.settings.request_timeout_s
        own = (started if budget_from is None else budget_from) + budget
        if client_left is not None and started + client_left >= own:
            client_left = None  # the router's own budget ends first: the error names it
        deadline = own if client_left is None else started + client_left
        gone = threading.Event()  # set once this coroutine is done with `_prepare`'s thread

        def ended() -> bool:
            return gone.is_set() or time.monotonic() > deadline

        media = MediaHold(self.held, holds, caller.tenant)
        outcome = Outcome(request_id, caller.tenant, started if arrived is None else arrived)
        try:
            async for chunk in self._generate(
                request, caller, outcome, media, deadline, ended, gone, fit_max_tokens
            ):
                outcome.saw(chunk)
                yield chunk
        except BaseException as exc:
            outcome.failed(self.stopping.seen(told(exc, budget, client_left)))
            raise_told(exc, budget, client_left)
        finally:
            self.orchestrator.metrics.finished.labels(outcome.outcome).inc()
            outcome.log()

    async def _generate(
        self,
        request: router_service_pb2.GenerateRequest,
        caller: Caller,
        outcome: Outcome,
        media: MediaHold,
        deadline: float,
        ended: Callable[[], bool],
        gone: threading.Event,
        fit_max_tokens: bool,
    ) -> AsyncGenerator[router_service_pb2.GenerateResponse, None]:
        """`generate`'s work, `outcome` filled as it goes."""
        async with self.lifecycle.track(), self.orchestrator.metrics.request():
            try:
                check_ids(request)
                # What needs no media first (limits come before work); resume_tokens again
                # below, against max_tokens as fitted to the prompt.
                check_stop(request.stop)
                vocab = self.processor.config.text.vocab_size
                if request.sampling.max_tokens:
                    check_resume(request, request.sampling.max_tokens, vocab)
                salt = request.cache_salt if request.HasField("cache_salt") else None
                cache_salt = tenant_salt(self.salt_key, caller.tenant, salt, caller.cache_epoch)
                # What it processes is cached once it is answered: a refusal changes no cache.
                cache = self.processor.image_cache
                staged = None if cache is None else StagedImages(cache)
                try:
                    sampling, prompt = await self.prepare_threads.run(
                        has_media(request),
                        caller.tenant,
                        self._prepare,
                        request,
                        cache_salt,
                        media,
                        fit_max_tokens,
                        ended,
                        staged,
                    )
                finally:
                    gone.set()  # the caller left (cancelled) or it is over
                if fit_max_tokens:  # a default: cut to the decode pool too
                    admission = self.orchestrator.admission
                    sampling = fitted_to_decode(admission, sampling, len(prompt.prompt_token_ids))
                ends = (self.orchestrator.stop, sampling)
                resumed = check_resume(request, sampling.max_tokens, vocab, ends)
            except BaseException as exc:
                media.give_back()
                if not isinstance(exc, InputError | FieldError):
                    raise
                if time.monotonic() > deadline:  # passed while its media decoded
                    raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
                raise invalid(str(exc), exc.field, isinstance(exc, ContextTooLong)) from None
            outcome.prompt_tokens = len(prompt.prompt_token_ids)
            with media.holding(prompt):
                job = Job(
                    request_id=outcome.request_id,
                    prompt=prompt,
                    sampling=sampling,
                    cache_salt=cache_salt,
                    deadline=deadline,
                    resumed=resumed,
                    tenant=caller.tenant,
                    prompt_field="prompt" if request.HasField("prompt") else "messages",
                    default_length=fit_max_tokens or not request.sampling.max_tokens,
                )
                await self.returns.wait(needed(job), deadline)
                answer = self.orchestrator.run(job)
                if request.stop:  # its own detokenizer, made only when there is a stop string
                    detok = IncrementalDetokenizer.of_answer(self.processor, sampling, resumed)
                    answer = stop_at(answer, request.stop, detok)
                async for chunk in self.orchestrator.metrics.track(answer, outcome.started):
                    if staged is not None:
                        staged.keep()
                    yield chunk

    async def Generate(self, _requests: Any, context: grpc.aio.ServicerContext) -> None:
        """Stream the answer to one chat (`generate`, as the authenticated caller), read once
        `held` lets it be and held until it ends (`router.held`: requests_in_flight_mb)."""
        longest, left = self.settings.request_timeout_s, context.time_remaining()
        caller = principal(self.auth, context)
        try:
            within = longest if left is None else min(left, longest)
            most = self.settings.model_len(self.processor.config.text.max_position_embeddings)
            bounds = (most, self.settings.max_prompt_text_bytes)
            sized = await read_request(self.held, context, within, caller.tenant, *bounds)
        except grpc.aio.AbortError:  # refused before it was read (the bytes held, corrupt)
            finished = self.orchestrator.metrics.finished
            refused_before(finished, caller.tenant, context.code(), context.details() or "")
            raise
        request, size, failed = sized.request, sized.size, None
        request.request_id = request.request_id or uuid.uuid4().hex  # one id in every log line
        try:
            left = context.time_remaining()
            async with self.stopping.answering():  # ended saying why when the drain runs out
                async for chunk in self.generate(request, caller, left, size):
                    if context.done():  # past the client's deadline: gRPC ended the call
                        return
                    # Written, not yielded: a drain's cancel lands here, not in gRPC's write
                    # outside `answering` ("Cancelling all calls": 8 of 12 fast streams, s45).
                    await context.write(chunk)
        except RouterError as exc:  # logged by `generate`
            failed = (exc.code, str(exc), exc.trailing_metadata)
        except RpcStatusError as exc:  # draining
            failed = (exc.code, exc.details, ())
        finally:
            self.held.give(size, caller.tenant)
        del request, sized  # gRPC keeps an abort in a cycle with this frame: not the request
        if failed is not None and not context.done():  # else writing fails, logged by gRPC
            await context.abort(failed[0], failed[1], trailing_metadata=failed[2])


@dataclass(slots=True, eq=False)
class RunningRouter(RoleServer[RouterServicer]):
    """A started router (`RoleServer.stop` stops it, in the module docstring's order)."""

    @property
    def orchestrator(self) -> Orchestrator:
        """Request execution: registry, peer client, prefix index, encode stage."""
        return self.servicer.orchestrator

    @property
    def registry(self) -> Registry:
        """The worker registry."""
        return self.servicer.orchestrator.registry

    http_address: str | None = field(default=None, kw_only=True)  # HTTP API (None: off)


async def serve(
    settings: RouterSettings,
    *,
    extra_servicers: Sequence[AddServicer] = (),
    scaler: Scaler | None = None,
) -> RunningRouter:
    """Start the router; returns once it listens (the caller stops it). `extra_servicers` are
    `add_*Servicer_to_server`-style callables served on the same port (e.g. by `epd serve`);
    `scaler` backs AdminService.Scale (None: UNIMPLEMENTED)."""
    settings.check()  # refuse to start without the secrets security needs, before any work
    auth = Authenticator.from_settings(settings.security, api_keys=True)
    salt_key = settings.security.cluster_key("router")
    path = await asyncio.to_thread(checkpoint_path, settings.model)
    processor = await asyncio.to_thread(
        Processor.from_pretrained, path, image_cache_bytes=settings.processed_image_cache_mb << 20
    )
    await asyncio.to_thread(lambda: processor.token_bytes)  # built once, off the event loop
    if not settings.expected_model:  # else it may hold no weights (tokenizer and config)
        # Its headers (no tensor read): a router that started on weights no worker can load
        # served UNAVAILABLE for good where nothing restarts it (Kubernetes).
        await asyncio.to_thread(check_checkpoint, path, processor.config)
    text = processor.config.text
    if (asked := settings.max_model_len or 0) > (most := text.max_position_embeddings):
        logger.warning("max_model_len %d: capped to the checkpoint's %d positions", asked, most)
    expected = settings.expected_model or await asyncio.to_thread(
        model_identity, path, processor.config
    )
    registry = Registry(
        worker_timeout_s=settings.worker_timeout_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        expected_model=expected,
        expected_processor=settings_digest(processor.settings),
        checkpoint_shape=CheckpointShape(
            text.num_hidden_layers, text.num_key_value_heads, text.head_dim
        ),
    )
    peers = PeerClient(
        release_timeout_s=settings.release_timeout_s,
        max_message_mb=settings.max_message_mb,
        credentials=service_credentials(settings.security),
        keepalive_s=settings.worker_keepalive_s,
    )
    orchestrator = Orchestrator(
        registry,
        peers,
        processor,
        max_inline_embedding_bytes=settings.max_inline_embedding_mb * 1024 * 1024,
        cache_aware=settings.cache_aware_routing,
        overlap_prefill=settings.overlap_prefill,
        encoder_affinity_slack=settings.encoder_affinity_slack,
        kv_affinity_slack=settings.kv_affinity_slack,
        reprefills=settings.kv_reprefills,
        migrations=settings.decode_migrations,
        max_queued_requests=settings.max_queued_requests,
        max_queue_wait_s=settings.max_queue_wait_s,
        embedding_cache_bytes=settings.embedding_cache_mb << 20,
        tenant_share=settings.tenant_share_for(auth.client_tenants if auth else 0),
    )
    registry.on_restart.append(lambda old: forget_restarted(orchestrator, old))
    if settings.cache_aware_routing:
        registry.on_register.append(
            lambda w: orchestrator.prefix.track(w.address, w.role) if w.role in KV_ROLES else None
        )
    lifecycle = ServerLifecycle()
    servicer = RouterServicer(
        processor, orchestrator, lifecycle, settings, auth=auth, salt_key=salt_key
    )
    servicer.returns.follow(registry, orchestrator.calls)
    running = await RunningRouter.start(
        settings,
        servicer,
        add_router_service,
        (
            service_name(router_service_pb2, "RouterService"),
            service_name(registry_service_pb2, "RegistryService"),
            service_name(admin_service_pb2, "AdminService"),
        ),
        lifecycle=lifecycle,
        extra_servicers=[
            lambda s: registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(
                RegistryServicer(registry), s
            ),
            lambda s: admin_service_pb2_grpc.add_AdminServiceServicer_to_server(
                AdminServicer(
                    registry, scaler, orchestrator.admission, lambda: orchestrator.metrics.in_flight
                ),
                s,
            ),
            *extra_servicers,
        ],
        cleanup=[orchestrator.close, peers.close, servicer.prepare_threads.close],
        auth=auth,
        client_api=True,
        metrics=orchestrator.metrics.registry,
    )
    period = max(0.05, min(settings.heartbeat_interval_s, settings.worker_timeout_s / 2))
    running.tasks.append(asyncio.create_task(expire_loop(registry, orchestrator, period)))
    health = health_loop(running.registry, running.lifecycle, running.set_serving, min(period, 0.1))
    running.tasks.append(asyncio.create_task(health))
    try:
        if settings.http_port < 0:
            orchestrator.metrics.watch(running.servicer)
        else:
            from router.http.serve import start_http  # FastAPI and uvicorn only when served

            await start_http(running, settings, path)
    except BaseException:
        await running.stop(0)
        raise
    logger.info("router on %s serving %s (model %s)", running.address, path, expected)
    return running
