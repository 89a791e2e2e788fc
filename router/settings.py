"""Router settings: the front door's TOML table and `python -m router` flags."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from PIL import Image

from common.processing.limits import (
    IMAGE_FORMATS,
    MAX_FPS,
    MAX_IMAGE_PIXELS,
    MIN_FPS,
    InputLimits,
)
from common.settings.base import ServerSettings, check_distinct_ports
from common.settings.schema import SettingsError, check_not_negative, check_positive, setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterSettings(ServerSettings):
    """Everything `router.server.serve` needs; every field has a documented default.

    host, max_message_mb and drain_timeout_s come from `ServerSettings`; `port` is declared
    there too and only its default differs here.
    """

    port: int = setting(50051, "port to listen on (0: pick a free one)")
    model: str | None = setting(
        None, "checkpoint folder the router processes inputs for (None: the built-in tiny model)"
    )
    heartbeat_interval_s: float = setting(
        1.0, "how often workers are told to heartbeat (0.05 to 3600 s)"
    )
    worker_timeout_s: float = setting(
        5.0, "a worker whose last heartbeat is older than this is dropped"
    )
    worker_keepalive_s: float = setting(
        10.0,
        "a worker that leaves an HTTP/2 ping unanswered this long, sent after this long of a "
        "call, fails the router's calls on it, which are then tried on another worker (a "
        "frozen process, a lost network path; a killed one fails them at once); a new "
        "connection must finish its handshake within twice this (at least 1 s)",
    )
    request_timeout_s: float = setting(
        300.0, "longest a request may run when the client sets no earlier deadline"
    )
    release_timeout_s: float = setting(
        5.0, "deadline of the ReleaseKv call that frees a lease decode never took"
    )
    max_inline_embedding_mb: int = setting(
        128,
        "largest total of inline embedding bytes one request may carry through the router; "
        "larger outputs must come as NIXL handles",
    )
    expected_model: str | None = setting(
        None,
        "model identity workers must report (None: derived from the checkpoint when the "
        "runtime can, else the first registered worker's)",
    )
    cache_aware_routing: bool = setting(
        True,
        "send prefill and decode each to the worker caching the longest prefix (among the "
        "least loaded) and skip encoding items the prefill worker's prefix covers",
    )
    overlap_prefill: bool = setting(
        False,
        "encode a request's images one by one and its videos as spans of partitions while "
        "the chosen prefill worker prefills the prompt up to the first one not yet encoded "
        "as each arrives (the request's prefill reuses those blocks; needs "
        "cache_aware_routing)",
    )
    encoder_affinity_slack: int = setting(
        2,
        "send each image to the encoder its content hash maps to (rendezvous hashing, so "
        "its encoder cache hits) unless that encoder has more than this many requests beyond "
        "the least loaded one; 0: no affinity, each request to the least loaded encoder",
    )
    kv_affinity_slack: int = setting(
        2,
        "send a request's prefill and its decode each to the worker caching the longest "
        "prefix of its prompt among those with at most this many requests beyond the least "
        "loaded one (with cache_aware_routing); 0: the least loaded, a cached prefix only "
        "breaking ties",
    )
    allow_special_tokens_in_text: bool = setting(
        False,
        "read special tokens typed in message text (e.g. <|im_start|>) as control tokens; "
        "off: they are plain text and only the chat template inserts control tokens",
    )
    max_prompt_text_bytes: int = setting(
        1 << 20, "most UTF-8 bytes of message text and roles in one request, before tokenizing"
    )
    max_model_len: int | None = setting(
        None,
        "most prompt tokens + max_tokens of one request (None: max_position_embeddings of "
        "the checkpoint's config; larger values are capped to it, said at start)",
    )
    max_image_pixels: int = setting(
        16384 * 32 * 32,
        "most width x height of one image or video frame, read from its header before "
        "decoding (the default is the released processor's max_pixels, 4096 x 4096; at most "
        "67108864, 8192 x 8192)",
    )
    max_video_frames: int = setting(768, "most frames one video may send")
    max_media_bytes: int = setting(
        512 << 20,
        "most bytes one request's media may take: decoded pixels (4 per pixel; of a video "
        "file, the frames the processor samples, resized as they decode, 3 a resized pixel) "
        "and the patch codes processing makes of them, summed over all images and frames, "
        "and once the most one item takes beside those for a while (a progressive JPEG's "
        "coefficients, 2 a band, WebP's decoder, 12 a pixel, or FFmpeg's buffers, 20 frames "
        "in the stream's own format, and one decoded frame, while it decodes; an EXIF turn "
        "and RGB copies, 4 a pixel each, and the resized copies, 7 a resized pixel, while it "
        "is processed), from their headers before any is decoded",
    )
    max_video_file_bytes: int = setting(
        256 << 20, "most bytes of one video file (mp4, webm, mkv), checked before it is opened"
    )
    max_video_seconds: float = setting(
        600.0, "longest video file, by its header's duration, checked before any frame is decoded"
    )
    max_video_decoded_pixels: int = setting(
        10**11,
        "most pixels decoded from one video file: frames decode in order up to the last one "
        "kept, kept or not (checked from the header where it states a frame rate, and while "
        "decoding); about 13 minutes of 1080p at 60 fps, some 70 s of one CPU core",
    )
    video_file_fps: float = setting(
        2.0,
        "frames per second a video file is sampled at when the request gives no fps; "
        "at most max_video_frames, spread over the video when more (the processor then "
        "samples those frames as any frame list)",
    )
    tenant_share: float = setting(
        0.5,
        "most of requests_in_flight_mb, of the gRPC reads it allows and of the calls waiting "
        "to be read, and of max_queued_requests, one tenant may hold or fill at once, where "
        "the API keys name several tenants with client keys (past it: refused, or the read "
        "waits, unless the tenant holds nothing else); while other tenants wait for KV "
        "blocks, its requests past that share of a KV role's blocks are placed after "
        "theirs; 1: no per-tenant share",
    )
    image_formats: tuple[str, ...] = setting(
        IMAGE_FORMATS,
        "image file formats the router decodes, by PIL's names, any case (comma-separated as "
        "a flag); "
        "an image (or video frame) in another is refused from its first bytes, before any of "
        "PIL's decoders for other formats sees it (EPS would run Ghostscript, when installed)",
    )
    http_host: str = setting("127.0.0.1", "address the OpenAI-compatible HTTP API listens on")
    http_port: int = setting(
        8000, "port of the OpenAI-compatible HTTP API (0: pick a free one; -1: no HTTP API)"
    )
    chat_max_tokens: int = setting(
        1024,
        "max_tokens of an HTTP chat completion that sets neither max_tokens nor "
        "max_completion_tokens, cut to the context the prompt leaves and to what the largest "
        "decode worker's pool holds beside it (OpenAI's is all that context, which every such "
        "request would reserve on a decode worker until it ends); a prompt that leaves that "
        "pool no room for a token is refused naming messages",
    )
    served_model_name: str | None = setting(
        None,
        "model id the HTTP API serves and lists at /v1/models (None: the checkpoint folder's "
        "name); requests naming another model get 404",
    )
    http_media_dir: str | None = setting(
        None,
        "folder whose files HTTP requests may name as media (a path inside it, absolute or "
        "relative to it, or a file:// URL; None: local files are refused)",
    )
    http_fetch_urls: bool = setting(
        False,
        "let HTTP requests name media by https:// URL, fetched by the router (hosts resolving "
        "to private, loopback or link-local addresses are refused)",
    )
    http_fetch_timeout_s: float = setting(10.0, "longest one media URL fetch may take")
    http_fetch_max_bytes: int = setting(64 << 20, "largest media file one URL fetch may return")
    http_max_connections: int = setting(
        1024,
        "HTTP connections the router keeps open at once; one past it is answered 503 with "
        "Retry-After: 1 and closed as it opens (each is a file descriptor the gRPC server "
        "and the workers' channels draw on too; 0: no cap)",
    )
    http_header_timeout_s: float = setting(
        20.0,
        "seconds an HTTP connection may take to send a whole request head, from its opening "
        "or its previous answer, before the router closes it",
    )
    requests_in_flight_mb: int = setting(
        1024,
        "MiB of requests the router holds at once, summed over the HTTP bodies and gRPC "
        "Generate requests being read or answered and their media (reserved from the image "
        "headers before decoding, then their patch codes); "
        "one past it gets HTTP 429 with Retry-After or gRPC RESOURCE_EXHAUSTED with "
        "retry-after-ms unless no other is held; at most this / max_message_mb gRPC requests "
        "(at least one) are being read at once, and this / 4 MiB wait to be (0: no bound)",
    )
    decode_migrations: int = setting(
        2,
        "times one decode stream is resumed on another decode worker after the one serving it "
        "fails mid-stream (0: the client gets UNAVAILABLE at once)",
    )
    kv_reprefills: int = setting(
        2,
        "times a request is prefilled again when decode refuses the pulled KV (its lease "
        "ran out or a block failed its digest) before the client gets ABORTED",
    )
    max_queued_requests: int = setting(
        512,
        "requests that may wait in the router for the KV blocks they need on a prefill and a "
        "decode worker; past that, new ones are refused with RESOURCE_EXHAUSTED "
        "(0: refuse at once what does not fit); as many may wait for a restarting role's "
        "worker, past that failing UNAVAILABLE at once (0: none waits)",
    )
    max_queue_wait_s: float = setting(
        60.0,
        "longest a request waits in that queue (in all, requeues after a full prefill pool "
        "included) before it is refused with RESOURCE_EXHAUSTED and a back-off hint; also "
        "the longest it waits for a role's last worker to come back from a restart",
    )
    grace_s: float = setting(
        5.0,
        "ignored (kept so files that set it still load): in-flight requests get "
        "drain_timeout_s on shutdown ([pools] drain_timeout_s under `epd serve`)",
    )
    processed_image_cache_mb: int = setting(
        256,
        "MiB of patch rows the router keeps for images and video temporal patches it "
        "processed, keyed by a digest of the encoded bytes and the processor settings (a "
        "patch: of its frames' and their resized size), so a repeated image, or a video's "
        "frames sent again, is not decoded, resized and hashed again (0: off)",
    )
    embedding_cache_mb: int = setting(
        64,
        "MiB of encoder outputs the router keeps (whole items that came back inline), keyed "
        "by content hash, cache salt and model, so an item seen again whose KV the prefill "
        "worker holds only in part (a repeated image, the text after it new) needs no Encode "
        "call: the kept rows go to the prefill worker (0: off; each output counts 1 KiB of "
        "objects beside its bytes)",
    )

    def nth(self, index: int) -> RouterSettings:
        """The settings of router `index` (0: these) of several started together
        (`epd serve --routers N`): `port`, `http_port` and `metrics_port` plus `index`,
        except 0 (a free port each), -1 (no HTTP API) and None (no metrics endpoint)."""
        metrics = self.metrics_port
        return dataclasses.replace(
            self,
            port=self.port + index if self.port > 0 else self.port,
            http_port=self.http_port + index if self.http_port > 0 else self.http_port,
            metrics_port=metrics + index if metrics is not None and metrics > 0 else metrics,
        )

    def check_copies(self, count: int) -> None:
        """SettingsError unless `count` routers (`nth`; `epd serve`'s `pools.routers`) can
        listen on their ports: past 65535, or one router's port on another's (else caught
        only when the second router starts, after Ray did), named as `router.<key>`."""
        spans: dict[str, tuple[int, int]] = {}
        for name in ("port", "http_port", "metrics_port"):
            port = getattr(self, name) or 0
            last = port + count - 1
            if port <= 0:  # a free port each, or none
                continue
            if last > 65535:
                raise SettingsError(
                    f"router.{name}: {port} + {count - 1} (pools.routers - 1) is past port 65535"
                )
            for other, (lo, hi) in spans.items():
                if port <= hi and lo <= last:
                    raise SettingsError(
                        f"router.{name}: {port}..{last} overlaps router.{other} {lo}..{hi} "
                        f"with pools.routers = {count} (router n listens on each port + n)"
                    )
            spans[name] = (port, last)

    def check(self) -> None:
        """Raise SettingsError naming the first unusable field; the router also needs the
        API keys file unless insecure."""
        ServerSettings.check(self)
        check_distinct_ports(self, "port", "http_port", "metrics_port")
        self.security.check(api_keys=True)
        check_not_negative(
            self,
            "max_queued_requests",
            "max_queue_wait_s",
            "http_fetch_max_bytes",
            "http_max_connections",
            "requests_in_flight_mb",
            "processed_image_cache_mb",
            "embedding_cache_mb",
            "max_inline_embedding_mb",
            "encoder_affinity_slack",
            "kv_affinity_slack",
            "decode_migrations",
            "kv_reprefills",
            "grace_s",  # ignored, but a number like the others
        )
        check_positive(  # a limit of 0 refused every request of its kind (s42 operator L5)
            self,
            "max_prompt_text_bytes",
            "max_image_pixels",
            "max_media_bytes",
            "max_video_file_bytes",
            "max_video_seconds",
            "max_video_decoded_pixels",
            "chat_max_tokens",
            "max_video_frames",
            "request_timeout_s",
            "release_timeout_s",
            "http_fetch_timeout_s",
            "http_header_timeout_s",
            "heartbeat_interval_s",
            "worker_timeout_s",
        )
        if self.http_fetch_urls and not self.http_fetch_max_bytes:  # (else unused: 0 is fine)
            raise SettingsError("http_fetch_max_bytes: must be positive to fetch media URLs")
        if not -1 <= self.http_port <= 65535:
            raise SettingsError("http_port: must be -1 (off), 0 (any free port) or a port")
        if self.max_image_pixels > MAX_IMAGE_PIXELS:  # else capped there, silently
            raise SettingsError(
                f"max_image_pixels: at most {MAX_IMAGE_PIXELS} (8192 x 8192, the most a "
                f"router decodes), got {self.max_image_pixels}"
            )
        if not MIN_FPS <= self.video_file_fps <= MAX_FPS:
            raise SettingsError(f"video_file_fps: must be from {MIN_FPS:g} to {MAX_FPS:g}")
        if not 0.05 <= self.heartbeat_interval_s <= 3600:
            # Below, every worker is asked for a heartbeat every few ms (a flood with many);
            # past 2^32 ms the answer to Register cannot carry it (workers looped registering).
            raise SettingsError("heartbeat_interval_s: must be from 0.05 to 3600 seconds")
        if not self.worker_timeout_s > self.heartbeat_interval_s:
            # Else a worker is dropped between two heartbeats it sends on time.
            raise SettingsError("worker_timeout_s: must be longer than heartbeat_interval_s")
        if not 0.1 <= self.worker_keepalive_s <= 3600:
            # Below 0.1 s a busy worker's pings could go unanswered; gRPC takes whole ms.
            raise SettingsError("worker_keepalive_s: must be from 0.1 to 3600 seconds")
        if not 0 < self.tenant_share <= 1:
            raise SettingsError("tenant_share: must be above 0 and at most 1")
        if self.grace_s != 5.0:
            logger.warning(
                "grace_s is ignored: in-flight requests get drain_timeout_s on shutdown "
                "([pools] drain_timeout_s under `epd serve`)"
            )
        if self.overlap_prefill and not self.cache_aware_routing:  # started silently
            raise SettingsError(
                "overlap_prefill: needs cache_aware_routing (the request's prefill would go "
                "to another worker than the one that prefilled its start)"
            )
        Image.init()  # every plugin PIL has registered
        unknown = [f for f in self.image_formats if f.upper() not in Image.OPEN]
        if unknown or not self.image_formats:
            raise SettingsError(
                f"image_formats: {', '.join(unknown) or 'empty'}: expected some of "
                f"{', '.join(sorted(Image.OPEN))}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SettingsError("max_model_len: must be at least 2")
        if self.max_model_len is not None:
            check_positive(self, "max_model_len")  # (its ceiling)

    def tenant_share_for(self, client_tenants: int) -> float:
        """The share of the router's bounds one tenant may take: `tenant_share` where the
        API keys name several tenants with client keys, else 1 (no per-tenant share)."""
        return self.tenant_share if client_tenants > 1 else 1.0

    def model_len(self, positions: int) -> int:
        """The most tokens one request takes on a checkpoint of `positions`."""
        return min(self.max_model_len or positions, positions)

    def input_limits(self, context: int) -> InputLimits:
        """The request limits, for a model of `context` positions."""
        return InputLimits(
            max_text_bytes=self.max_prompt_text_bytes,
            max_image_pixels=self.max_image_pixels,
            max_video_frames=self.max_video_frames,
            max_media_bytes=self.max_media_bytes,
            max_video_file_bytes=self.max_video_file_bytes,
            max_video_seconds=self.max_video_seconds,
            max_video_decoded_pixels=self.max_video_decoded_pixels,
            video_file_fps=self.video_file_fps,
            image_formats=tuple(f.upper() for f in self.image_formats),
            max_model_len=self.model_len(context),
        )

    @property
    def address(self) -> str:
        """host:port as configured (port 0 is resolved only once the server is up)."""
        return f"{self.host}:{self.port}"
