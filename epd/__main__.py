"""`python -m epd ...`: the same command line as the `epd` console script (see cluster.cli)."""

from __future__ import annotations

import sys

from cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
