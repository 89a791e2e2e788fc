"""The `epd` command line: serve, generate, scale, status, drain, config.

    epd serve [--config epd.toml] [--address RAY] [--FLAG VALUE ...]   run a deployment on Ray
    epd generate "prompt" [--image PATH] [--video DIR] [--fps F]       stream one answer
    epd scale --role prefill --replicas 3                              resize a pool
    epd status                                                         every worker and its load
    epd drain HOST:PORT                                                stop routing to a worker
    epd config --print-defaults | --check FILE | --markdown           the config file

Every command but `serve` and `config` talks to a running router (`--address`, default
127.0.0.1:50051, or $EPD_ROUTER). This module is the only place in `epd` that prints;
the library code it calls logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_ROUTER = "127.0.0.1:50051"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")


def _router_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=os.environ.get("EPD_ROUTER", DEFAULT_ROUTER),
        help="router address host:port (default: $EPD_ROUTER or %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `epd` parser with every subcommand (also used by the deploy tests)."""
    from epd.settings import ROLES, EpdSettings

    parser = argparse.ArgumentParser(
        prog="epd", description="Disaggregated encode / prefill / decode serving."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="start the router and the worker pools on Ray",
        usage="epd serve [--config FILE.toml] [--address RAY_ADDRESS] [--SECTION-KEY VALUE ...]",
        description="Start or join a Ray cluster, then run the router and one pool of worker "
        "actors per role until Ctrl-C. With no arguments it serves the built-in tiny model. "
        "Every setting of the config file is also a flag (see docs/config.md); flags win.",
    )
    serve.add_argument("--config", metavar="FILE.toml", help="settings file (TOML)")
    serve.add_argument(
        "--address",
        dest="ray__address",
        default=argparse.SUPPRESS,
        metavar="RAY_ADDRESS",
        help="Ray cluster to join ('auto': the one on this node); same as --ray-address",
    )
    _add_settings_flags(serve, EpdSettings)

    generate = commands.add_parser(
        "generate", help="stream an answer from a running router, then print timings"
    )
    generate.add_argument("prompt", help="the user's text")
    generate.add_argument(
        "--image", action="append", default=[], metavar="PATH", help="an image file (repeatable)"
    )
    generate.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of frame images, in name order (repeatable)",
    )
    generate.add_argument("--fps", type=float, default=2.0, help="frames per second of --video")
    generate.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed")
    generate.add_argument("--system", default=None, help="a system message")
    _router_flag(generate)

    scale = commands.add_parser("scale", help="resize a worker pool (through the router)")
    scale.add_argument("--role", required=True, choices=ROLES)
    scale.add_argument("--replicas", required=True, type=int)
    scale.add_argument(
        "--no-wait", action="store_true", help="return once asked, not when the pool has changed"
    )
    scale.add_argument("--timeout", type=float, default=300.0, help="longest wait, seconds")
    _router_flag(scale)

    status = commands.add_parser("status", help="show every registered worker and its load")
    _router_flag(status)

    drain = commands.add_parser("drain", help="stop routing new work to one worker")
    drain.add_argument("worker", metavar="HOST:PORT", help="the worker's registered address")
    _router_flag(drain)

    config = commands.add_parser("config", help="print or check the config file")
    action = config.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--print-defaults", action="store_true", help="every setting with its default (TOML)"
    )
    action.add_argument("--check", metavar="FILE.toml", help="load FILE and report errors")
    action.add_argument(
        "--markdown", action="store_true", help="the reference table of docs/config.md"
    )
    return parser


def _add_settings_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """`common.settings.add_flags` for `cls`, with one help group per TOML section."""
    import dataclasses
    import typing

    from common.settings import add_flags

    hints = typing.get_type_hints(cls)
    top = parser.add_argument_group("top-level settings")
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            group = parser.add_argument_group(f"[{f.name}] settings", f.metadata.get("help"))
            add_flags(typing.cast(argparse.ArgumentParser, group), tp, prefix=f"{f.name}.")
        else:
            top.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                default=argparse.SUPPRESS,
                metavar="VALUE",
                help=f"{f.metadata.get('help', '')} (default: {f.default!r})",
            )


def load_settings(args: argparse.Namespace) -> Any:
    """`EpdSettings` from the defaults, `--config`, then the flags (SettingsError if bad)."""
    from common.settings import apply_flags, load
    from epd.settings import EpdSettings

    return apply_flags(load(EpdSettings, getattr(args, "config", None)), args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `epd` console script and `python -m epd`."""
    from common.settings import SettingsError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(load_settings(args))
        if args.command == "config":
            return cmd_config(args)
        runner = {"generate": cmd_generate, "scale": cmd_scale, "status": cmd_status}
        if args.command in runner:
            return asyncio.run(runner[args.command](args))
        return asyncio.run(cmd_drain(args))
    except SettingsError as exc:
        parser.exit(2, f"epd: error: {exc}\n")
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        import grpc

        from epd.client import GenerateError

        if isinstance(exc, grpc.aio.AioRpcError):
            parser.exit(1, f"epd: {args.command} failed: {exc.code().name}: {exc.details()}\n")
        if isinstance(exc, GenerateError):
            parser.exit(1, f"epd: {args.command} failed: {exc}\n")
        raise


def _say(line: str) -> None:
    print(line, flush=True)


# ----------------------------------------------------------------------------------- serve


def cmd_serve(settings: Any) -> int:
    """Start (or join) Ray, run the deployment until SIGINT/SIGTERM, then stop it cleanly."""
    import logging

    from epd.pools import init_ray

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _prepare_checkpoint(settings)
    started = time.monotonic()
    if settings.ray.address:
        _say(f"joining the Ray cluster at {settings.ray.address}")
    else:
        _say("starting a local Ray cluster")
    started_ray = init_ray(settings.ray)
    return asyncio.run(_serve(settings, started_ray, started))


def _prepare_checkpoint(settings: Any) -> None:
    """Make the built-in tiny checkpoint now (with a progress line) when a role will need it."""
    from common.models.tiny import default_checkpoint

    wanted = [settings.model] + [
        getattr(s, "model", None)
        for s in (settings.router, settings.encoder, settings.prefill, settings.decode)
    ]
    if settings.model is not None or all(m is not None for m in wanted[1:]):
        return
    _say("preparing the built-in tiny checkpoint (random weights; made on first use) ...")
    t0 = time.monotonic()
    path = default_checkpoint("tiny")
    _say(f"checkpoint {path} ready in {time.monotonic() - t0:.1f}s")


async def _serve(settings: Any, started_ray: bool, started: float) -> int:
    from epd.pools import Deployment, WorkerStartError, error_summary

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    deployment: Deployment | None = None
    code = 0
    try:
        deployment = await _until(stop, Deployment.start(settings, started_ray=started_ray))
        if deployment is None:
            return 130
        _say(f"router listening on {deployment.address}")
        pools = settings.pools.initial_replicas()
        _say("waiting for " + ", ".join(f"{n} {role}" for role, n in pools.items()) + " ...")
        ready = await _until(stop, deployment.wait_ready(settings.pools.ready_timeout_s))
        if ready is None:
            return 130
        counts = ", ".join(f"{n} {role}" for role, n in ready.items())
        _say(f"ready in {time.monotonic() - started:.1f}s: {counts} registered")
        _say(f'try: epd generate "Describe the image." --image IMG --address {deployment.address}')
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 5.0)
            if not stop.is_set() and not await deployment.alive():
                _say("the controller actor died; stopping")
                code = 1
                break
        return code
    except (TimeoutError, WorkerStartError) as exc:
        _say(f"not ready: {error_summary(exc)}")
        return 1
    finally:
        _say("stopping ...")
        if deployment is not None:
            await deployment.stop(on_step=_say)
        elif started_ray:
            import ray

            ray.shutdown()
        _say("stopped")


async def _until(stop: asyncio.Event, work: Any) -> Any:
    """Await `work` unless `stop` is set first (then cancel it and return None)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return None


# -------------------------------------------------------------------------------- generate


def frame_files(folder: str | Path) -> list[Path]:
    """The image files of a frames folder, in name order; ValueError when there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--video {folder}: not a folder of frame images")
    frames = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not frames:
        raise ValueError(f"--video {folder}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    return frames


def build_messages(
    prompt: str,
    images: Sequence[str | Path] = (),
    videos: Sequence[str | Path] = (),
    *,
    fps: float = 2.0,
    system: str | None = None,
) -> list[dict[str, Any]]:
    """The chat for one user turn: images, then videos (each a frames folder), then text."""
    content: list[dict[str, Any]] = []
    for image in images:
        content.append({"type": "image", "image": Path(image).read_bytes()})
    for video in videos:
        frames = [p.read_bytes() for p in frame_files(video)]
        content.append({"type": "video", "video": frames, "fps": fps})
    content.append({"type": "text", "text": prompt})
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    messages.append({"role": "user", "content": content})
    return messages


async def cmd_generate(args: argparse.Namespace) -> int:
    """Stream the answer, then one line of timing and cache statistics."""
    from common.sampling import SamplingParams
    from epd.client import generate

    try:
        messages = build_messages(
            args.prompt, args.image, args.video, fps=args.fps, system=args.system
        )
        sampling = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
        )
    except (OSError, ValueError) as exc:
        _say(f"epd: {exc}")
        return 2
    t0 = time.monotonic()
    ttft = 0.0
    tokens = 0
    finish = ""
    stats = dict.fromkeys(("prompt_tokens", "cached_tokens", "blocks_reused", "blocks_pulled"), 0)
    async for chunk in generate(args.address, messages, sampling):
        if tokens == 0 and chunk.token_ids:
            ttft = time.monotonic() - t0
        tokens += len(chunk.token_ids)
        # The first chunk (prefill) carries the prompt counts, the first decode chunk the
        # KV block counts.
        for key, value in stats.items():
            stats[key] = value or getattr(chunk, key)
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        finish = chunk.finish_reason or finish
    total = time.monotonic() - t0
    sys.stdout.write("\n")
    if tokens == 0:
        _say("(no answer)")
        return 1
    decode_s = total - ttft
    rate = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
    _say(
        f"--- {tokens} tokens ({finish or 'unfinished'}); TTFT {ttft * 1000:.0f} ms, "
        f"{rate:.1f} tokens/s after the first, {total:.2f} s total"
    )
    _say(
        f"--- prompt {stats['prompt_tokens']} tokens, {stats['cached_tokens']} from prefix "
        f"cache; KV blocks at decode: {stats['blocks_reused']} reused, "
        f"{stats['blocks_pulled']} pulled"
    )
    return 0


# ---------------------------------------------------------------------------- scale, status


async def _admin(address: str) -> Any:
    from common.rpc import channel
    from epd.v1 import admin_service_pb2_grpc

    ch = channel(address)
    return ch, admin_service_pb2_grpc.AdminServiceStub(ch)


async def cmd_scale(args: argparse.Namespace) -> int:
    """Ask the router's scaler for `--replicas` workers, then wait until the pool has them."""
    from epd.pools import registered_counts, wire_role
    from epd.v1 import admin_service_pb2

    ch, stub = await _admin(args.address)
    async with ch:
        before = (await registered_counts(stub)).get(args.role, 0)
        reply = await stub.Scale(
            admin_service_pb2.ScaleRequest(role=wire_role(args.role), replicas=args.replicas),
            timeout=60,
        )
        _say(f"{args.role}: {_workers(before)} -> {_workers(reply.replicas)}")
        if args.no_wait:
            return 0
        t0 = time.monotonic()
        while True:
            counts = await registered_counts(stub, include_draining=True)
            if counts.get(args.role, 0) == reply.replicas:
                took = time.monotonic() - t0
                _say(f"{args.role}: {_workers(reply.replicas)} registered ({took:.1f}s)")
                return 0
            if time.monotonic() - t0 > args.timeout:
                _say(f"{args.role}: still {counts.get(args.role, 0)} after {args.timeout:.0f}s")
                return 1
            await asyncio.sleep(0.2)


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


async def cmd_status(args: argparse.Namespace) -> int:
    """One line per worker: role, name, address, load, KV blocks, cache hits, heartbeat."""
    from epd.pools import role_name
    from epd.v1 import admin_service_pb2

    ch, stub = await _admin(args.address)
    async with ch:
        reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
    model = reply.model or "-"
    _say(f"router {args.address}  model {model}  requests in flight {reply.active_requests}")
    # LOAD: requests the worker reports in flight; ROUTED: requests this router has on it;
    # CACHE HITS: prefix (or encoder) cache hits / lookups since the worker started.
    header = ("ROLE", "NAME", "ADDRESS", "LOAD", "ROUTED", "KV USED/FREE", "CACHE HITS")
    rows = [(*header, "SEEN", "STATE")]
    for w in reply.workers:
        load = w.load
        kv = "-" if w.info.role == 1 else f"{load.kv_blocks_used}/{load.kv_blocks_free}"
        hits = f"{load.cache_hits}/{load.cache_lookups}"
        rows.append(
            (
                role_name(w.info.role),
                w.info.name or "-",
                w.info.address,
                str(load.active_requests),
                str(w.router_in_flight),
                kv,
                hits,
                f"{w.seconds_since_heartbeat:.1f}s ago",
                "draining" if w.draining else "serving",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        _say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if not reply.workers:
        _say("(no workers registered)")
    return 0


async def cmd_drain(args: argparse.Namespace) -> int:
    """AdminService.Drain: the router stops sending new work to the worker."""
    from epd.v1 import admin_service_pb2

    ch, stub = await _admin(args.address)
    async with ch:
        reply = await stub.Drain(admin_service_pb2.DrainRequest(address=args.worker), timeout=10)
    if not reply.found:
        _say(f"no registered worker at {args.worker}")
        return 1
    _say(f"{args.worker}: draining (no new work; in-flight work finishes)")
    return 0


# ---------------------------------------------------------------------------------- config


def cmd_config(args: argparse.Namespace) -> int:
    """Print the commented defaults, or load a file and report the first error."""
    from common.settings import load
    from epd.settings import EpdSettings, defaults_toml, reference_markdown

    if args.print_defaults:
        sys.stdout.write(defaults_toml())
        return 0
    if args.markdown:
        sys.stdout.write(reference_markdown())
        return 0
    load(EpdSettings, args.check)
    _say(f"{args.check}: ok")
    return 0
