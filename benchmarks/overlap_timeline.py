"""Where one request's time to first token went, from a deployment's debug logs
(`overlap_bench.py --log-dir`): the router's, encoder's and prefill worker's debug lines
carry the request id, so each event is placed in ms from the router's receipt of the
request (its "generated in" line, minus that time).

    .venv/bin/python benchmarks/overlap_timeline.py DIR [DIR ...]   (a deployment's log dir)

Per request: when the encode stage started (processing, hashing, routing and admission
before it), each `Encode` answer (with its partitions' rows), each prefill call's end
(steps and the request's own), and the first token (the end of the request's own prefill).
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ ([\w.]+): request (\w+)(\S*)")
_DONE = re.compile(r"generated in ([\d.]+) s")
_STAGES = re.compile(r"stages: encode ([\d.]+) ms .*prefill ([\d.]+) ms")


@dataclass
class Timeline:
    """One request's events, in seconds of the log clock."""

    done: float = 0.0  # the router's "generated in" line
    total_s: float = 0.0  # what that line says
    stages_at: float = 0.0  # the router's stages line (right after the own prefill)
    encode_ms: float = 0.0
    prefill_ms: float = 0.0
    encodes: list[float] = field(default_factory=list)  # Encode answers
    prefills: list[tuple[str, float]] = field(default_factory=list)  # (step or "", end)

    @property
    def start(self) -> float:
        return self.done - self.total_s


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read(folder: Path) -> dict[str, Timeline]:
    """The timelines of every request the logs in `folder` finished."""
    out: dict[str, Timeline] = defaultdict(Timeline)
    for name in ("router", "encoder", "prefill"):
        path = folder / f"{name}.log"
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if m is None:
                continue
            at, logger, request, suffix = _seconds(m[1]), m[2], m[3], m[4]
            t = out[request]
            if logger == "router.server" and (d := _DONE.search(line)):
                t.done, t.total_s = at, float(d[1])
            elif logger == "router.encode" and (s := _STAGES.search(line)):
                t.stages_at, t.encode_ms, t.prefill_ms = at, float(s[1]), float(s[2])
            elif logger == "encoder_worker.server" and "encode and answer" in line:
                t.encodes.append(at)
            elif logger == "prefill_worker.service" and "compute" in line:
                t.prefills.append((suffix.lstrip(":"), at))
    return {k: v for k, v in out.items() if v.done and v.stages_at}


def describe(request: str, t: Timeline) -> str:
    """One request's timeline, in ms from the router's receipt."""

    def ms(at: float) -> str:
        return f"{(at - t.start) * 1000:.0f}"

    first_token = t.stages_at
    encode_start = first_token - (t.encode_ms + t.prefill_ms) / 1000
    steps = [at for name, at in t.prefills if name]
    lines = [
        f"request {request[:8]}: first token at {ms(first_token)} ms "
        f"(encode stage {t.encode_ms:.0f} ms, own prefill {t.prefill_ms:.0f} ms)",
        f"  encode stage starts {ms(encode_start)} (processing, hashing, routing before it)",
        f"  Encode answers: {' '.join(ms(a) for a in sorted(t.encodes))}",
        f"  prefill steps end: {' '.join(ms(a) for a in sorted(steps)) or '-'}",
    ]
    if t.encodes:
        tail = (first_token - max(t.encodes)) * 1000
        lines.append(f"  tail (last Encode answer -> first token): {tail:.0f} ms")
    return "\n".join(lines)


def summary(folder: Path) -> str:
    """Every request's timeline, then `medians`."""
    timelines = read(folder)
    out = [describe(r, t) for r, t in sorted(timelines.items(), key=lambda kv: kv[1].start)]
    return "\n".join([*out, medians(folder, timelines)])


def medians(folder: Path, timelines: dict[str, Timeline] | None = None) -> str:
    """The median encode stage start and tail of the requests logged in `folder`."""
    timelines = read(folder) if timelines is None else timelines
    if not timelines:
        return f"{folder.name}: no finished request with debug lines"
    starts = [
        t.stages_at - (t.encode_ms + t.prefill_ms) / 1000 - t.start for t in timelines.values()
    ]
    tails = [t.stages_at - max(t.encodes) for t in timelines.values() if t.encodes]
    first = [min(t.encodes) - t.start for t in timelines.values() if t.encodes]
    text = f"{folder.name}: median encode stage start {statistics.median(starts) * 1000:.0f} ms"
    if tails:
        text += (
            f", first Encode answer {statistics.median(first) * 1000:.0f} ms, tail (last "
            f"Encode answer -> first token) {statistics.median(tails) * 1000:.0f} ms"
        )
    return text


def main() -> None:
    for folder in sys.argv[1:]:
        print(summary(Path(folder)))


if __name__ == "__main__":
    main()
