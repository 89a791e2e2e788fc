"""Where the `epd` command line writes: the only printing in `epd` (library code logs)."""


def say(line: str) -> None:
    """Write one line to stdout, flushed (progress of long commands shows at once)."""
    print(line, flush=True)
