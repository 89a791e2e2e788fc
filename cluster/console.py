"""Where the `epd` command line writes: the only printing in `epd` (library code logs)."""

import sys


def say(line: str) -> None:
    """Write one line to stdout, flushed (progress of long commands shows at once)."""
    print(line, flush=True)


def complain(line: str) -> None:
    """Write one line to stderr as `epd: line`: what made the command exit non-zero, or
    what an operator must know of what it did (`epd drain` of a role's last worker)."""
    print(f"epd: {line}", file=sys.stderr, flush=True)
