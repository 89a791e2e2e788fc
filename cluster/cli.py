"""The `epd` command line: serve, generate, scale, status, drain, undrain, config.

    epd serve [--config epd.toml] [--address RAY] [--FLAG VALUE ...]   run a deployment on Ray
    epd generate "prompt" [--image PATH] [--video FILE|DIR] [--fps F]  stream one answer
    epd scale --role prefill --replicas 3                              resize a pool
    epd status                                                         every worker and its load
    epd drain HOST:PORT|NAME                                           stop routing to a worker
    epd undrain HOST:PORT|NAME                                         route to it again
    epd config --print-defaults | --check FILE | --markdown           the config file
    epd make-examples [DIR]                                            the tour's media files

The other commands (not `serve`, `config`, `make-examples`) talk to a running router
(`--address`, default 127.0.0.1:50051, or $EPD_ROUTER) with an API key (`--api-key`, or
$EPD_API_KEY, or the key `epd serve` wrote: client_key for `generate`, admin_key for the
admin commands, under $EPD_HOME/<namespace>, default ~/.epd/epd) and, for a TLS router,
`--tls-ca-file`.
`serve` is in `cluster.serve`, `generate` in `cluster.generate`, the admin commands in
`cluster.admin` (`scale` in `cluster.scale`); they print through `cluster.console`, the
library code they call logs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cluster.admin import cmd_drain, cmd_status, cmd_undrain
from cluster.console import say as _say
from cluster.generate import build_messages as build_messages
from cluster.generate import cmd_generate
from cluster.generate import frame_files as frame_files
from cluster.hints import failure_hint
from cluster.scale import cmd_scale
from cluster.serve import cmd_serve

if TYPE_CHECKING:
    from cluster.settings import EpdSettings

DEFAULT_ROUTER = "127.0.0.1:50051"
STATUS_HELP = """\
Show the router's load, then one line per registered worker.

The first line: the router's address, the model it serves, requests in flight, requests
queued now (peak: the most ever queued at once; refused: turned away by admission: the queue
full, a wait past max_queue_wait_s, or a request that never fits).

Worker columns:
  ROLE          encoder, prefill or decode
  NAME          the worker's name (- when it has none)
  ADDRESS       host:port it registered; `epd drain` takes it or the NAME
  LOAD          requests the worker itself reports in flight
  ROUTED        requests this router has sent to it and not yet seen finish
  KV USED/FREE  paged KV blocks in use / free (- for an encoder: it holds no KV)
  CACHE HITS    prefix (encoder: embedding) cache hits / lookups since the worker started
  SEEN          time since its last heartbeat
  STATE         serving; suspect: a call on it failed and no heartbeat has cleared it since,
                so it gets new work only when no other of its role is left; or draining: no
                new work is routed to it (after `epd drain`, until `epd undrain`; or retiring
                after a scale-down, until it leaves)

Then a line counting each role as `epd scale` does (serving workers, draining ones apart),
a `waiting:` line per worker the deployment started that its cluster has not placed yet (or
restarts), a
`failed:` line per worker whose start raised since its pool was last scaled (it left the
pool), a `dropped:` line per worker the router dropped lately for its silence (until it
registers again), and a `refused:` line per worker whose registration the router refused."""


def _router_flag(parser: argparse.ArgumentParser, key_file: str = "client_key") -> None:
    parser.add_argument(
        "--address",
        default=os.environ.get("EPD_ROUTER", DEFAULT_ROUTER),
        help="router address host:port, or several comma-separated (generate sends a request "
        "that fails before its first token to the next; status and scale ask the first, drain "
        "and undrain tell each) (default: $EPD_ROUTER or %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        type=str.strip,  # pasted with a newline, it is no valid header value
        metavar="KEY",
        help=f"API key (default: $EPD_API_KEY, else the {key_file} file `epd serve` wrote "
        "under $EPD_HOME/<namespace>, default ~/.epd/epd)",
    )
    parser.add_argument(
        "--tls-ca-file",
        default=os.environ.get("EPD_TLS_CA_FILE"),
        metavar="PEM",
        help="dial the router over TLS, verifying it with this CA (default: $EPD_TLS_CA_FILE)",
    )


def _count(text: str) -> int:
    """A whole number, 0 or more (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


_WORKER_HELP = (
    "the worker's registered HOST:PORT or its NAME (as `epd status` lists them); every "
    "router --address lists is told"
)


def build_parser() -> argparse.ArgumentParser:
    """The `epd` parser with every subcommand (also used by the deploy tests)."""
    from cluster.settings import ROLES, EpdSettings

    # allow_abbrev=False everywhere: `--imag` is an error, not `--image`.
    parser = argparse.ArgumentParser(
        prog="epd",
        description="Disaggregated encode / prefill / decode serving.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,
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
    serve.add_argument(
        "--insecure",
        dest="security__insecure",
        action="store_const",
        const="true",
        default=argparse.SUPPRESS,
        help="run without authentication (no cluster token, no API keys, KV handles unsigned); "
        "same as --security-insecure true",
    )
    serve.add_argument(
        "--routers",
        dest="pools__routers",
        default=argparse.SUPPRESS,
        metavar="N",
        help="start N routers, every worker registered with all; same as --pools-routers",
    )
    _add_settings_flags(serve, EpdSettings)

    generate = commands.add_parser(
        "generate",
        allow_abbrev=False,
        help="stream an answer from a running router, then print timings",
    )
    generate.add_argument("prompt", help="the user's text")
    generate.add_argument(
        "--image", action="append", default=[], metavar="PATH", help="an image file (repeatable)"
    )
    generate.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="FILE|DIR",
        help="a video file (mp4, webm, mkv) or a folder of frame images, in name order "
        "(repeatable)",
    )
    generate.add_argument(
        "--fps",
        type=float,
        default=None,
        help="the rate a --video file is sampled at (default: the router's [router] "
        "video_file_fps); frames per second of a --video folder (default 2)",
    )
    generate.add_argument("--max-tokens", type=int, default=64, help="most tokens (default 64)")
    generate.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="end before TEXT (repeatable)"
    )
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed")
    generate.add_argument("--system", default=None, help="a system message")
    _router_flag(generate)

    scale = commands.add_parser(
        "scale", allow_abbrev=False, help="resize a worker pool (through the router)"
    )
    scale.add_argument("--role", required=True, choices=ROLES)
    scale.add_argument("--replicas", required=True, type=_count)
    scale.add_argument(
        "--no-wait", action="store_true", help="return once asked, not when the pool has changed"
    )
    scale.add_argument("--timeout", type=_seconds, default=300.0, help="longest wait, s (300)")
    _router_flag(scale, "admin_key")

    status = commands.add_parser(
        "status",
        allow_abbrev=False,
        help="show every registered worker and its load",
        description=STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _router_flag(status, "admin_key")

    drain = commands.add_parser(
        "drain", allow_abbrev=False, help="stop routing new work to one worker"
    )
    drain.add_argument("worker", metavar="WORKER", help=_WORKER_HELP)
    _router_flag(drain, "admin_key")

    undrain = commands.add_parser(
        "undrain", allow_abbrev=False, help="route new work to a drained worker again"
    )
    undrain.add_argument("worker", metavar="WORKER", help=_WORKER_HELP)
    _router_flag(undrain, "admin_key")

    examples = commands.add_parser(
        "make-examples",
        allow_abbrev=False,
        help="write the README tour's media: cat.png, clip/ (frames) and clip.mp4",
    )
    examples.add_argument("folder", nargs="?", default=".", help="where (default: here)")

    config = commands.add_parser(
        "config", allow_abbrev=False, help="print or check the config file"
    )
    action = config.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--print-defaults", action="store_true", help="every setting with its default (TOML)"
    )
    action.add_argument(
        "--check",
        metavar="FILE.toml",
        help="load FILE and report errors (reading the files it names: token, keys, TLS)",
    )
    action.add_argument(
        "--markdown", action="store_true", help="the reference table of docs/config.md"
    )
    return parser


def _add_settings_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """`common.settings.schema.add_flags` for `cls`, with one help group per TOML section."""
    import dataclasses
    import typing

    from common.settings.schema import add_flags

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


def load_settings(args: argparse.Namespace) -> EpdSettings:
    """`EpdSettings` from the defaults, `--config`, then the flags (SettingsError if bad)."""
    from cluster.settings import EpdSettings
    from common.settings.schema import apply_flags, load

    return apply_flags(load(EpdSettings, getattr(args, "config", None)), args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `epd` console script and `python -m epd`."""
    from common.settings.schema import SettingsError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # A wrong flag is the subcommand's error, printed with the subcommand's usage.
        sub = _subparser(parser, args.command)
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "serve":
            return cmd_serve(load_settings(args))
        if args.command == "config":
            return cmd_config(args)
        if args.command == "make-examples":
            return cmd_make_examples(args)
        runner = {
            "generate": cmd_generate,
            "scale": cmd_scale,
            "status": cmd_status,
            "drain": cmd_drain,
            "undrain": cmd_undrain,
        }
        return asyncio.run(runner[args.command](args))
    except SettingsError as exc:
        parser.exit(2, f"epd: error: {exc}\n")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (`epd status | head -1`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit's flush
        return 1
    except Exception as exc:
        import grpc

        from epd.client import GenerateError

        if isinstance(exc, grpc.aio.AioRpcError):
            hint = failure_hint(args, exc.code(), exc.details() or "")
            parser.exit(
                1, f"epd: {args.command} failed: {exc.code().name}: {exc.details()}{hint}\n"
            )
        if isinstance(exc, GenerateError):
            hint = failure_hint(args, exc.code, str(exc))
            parser.exit(1, f"epd: {args.command} failed: {exc}{hint}\n")
        if isinstance(exc, OSError):  # a file it names (--tls-ca-file, an image) unreadable
            parser.exit(1, f"epd: {args.command} failed: {exc}\n")
        if isinstance(exc, ValueError):  # an argument the library refuses, naming it
            parser.exit(2, f"epd: error: {exc}\n")
        raise


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type: `nan` never timed out)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand `command` (the top-level parser if there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    return parser


# --------------------------------------------------------------------------- make-examples


def cmd_make_examples(args: argparse.Namespace) -> int:
    """Write the tour's image, frame folder and video file (`cluster.examples`)."""
    from cluster.examples import make_examples

    for path in make_examples(args.folder):
        _say(f"wrote {path}{'/' if path.is_dir() else ''}")
    return 0


# ---------------------------------------------------------------------------------- config


def cmd_config(args: argparse.Namespace) -> int:
    """Print the commented defaults, or load a file and report the first error."""
    from cluster.settings import EpdSettings, defaults_toml, reference_markdown
    from common.settings.schema import SettingsError, load

    if args.print_defaults:
        sys.stdout.write(defaults_toml())
        return 0
    if args.markdown:
        sys.stdout.write(reference_markdown())
        return 0
    settings = load(EpdSettings, args.check)  # its errors name the file
    try:
        settings.check()  # the same check `epd serve` runs first
    except SettingsError as exc:
        raise SettingsError(f"{args.check}: {exc}") from None
    _say(f"{args.check}: ok")
    return 0
