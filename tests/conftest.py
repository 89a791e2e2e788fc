"""Suite-wide hooks: strict mode for CI.

With `EPD_STRICT=1` (set by `.ci/run`, and by `make test` when `CI=true`) a test, or a whole
module, that skips because `transformers` (the parity reference) or NIXL (the real transfer
path) is missing fails instead, naming the reason: DESIGN says CI exercises both, so a CI
machine without them must not pass quietly. Local runs still skip, with the reason.

The skips are found by their reason (`pytest.importorskip("transformers")` names the module,
the NIXL skips say "NIXL"), so a new test that skips the same way is covered without a
marker. A module-level skip turns into a collection error, which stops the run at once.

Also the module-scoped `ckpt` (the built-in tiny checkpoint) and `processor` fixtures most
modules share (a module that needs another checkpoint defines its own `ckpt`), and
`ckpt_copy`, a copy of the tiny checkpoint for a test to break.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Generator
from pathlib import Path

import pytest

from common.models.tiny import default_checkpoint
from common.processing.processor import Processor

pytest_plugins = ("pytester",)  # tests/test_strict_mode.py runs pytest on this file


@pytest.fixture(scope="module")
def ckpt() -> Path:
    """The built-in tiny checkpoint; a module that tests another defines its own `ckpt`."""
    return default_checkpoint("tiny")


@pytest.fixture(scope="module")
def processor(ckpt: Path) -> Processor:
    """The processor of the module's `ckpt`."""
    return Processor.from_pretrained(ckpt)


@pytest.fixture
def ckpt_copy(tmp_path: Path) -> Path:
    """A copy of the built-in tiny checkpoint, for a test to break."""
    out = tmp_path / "ckpt"
    shutil.copytree(default_checkpoint(), out)
    return out


def pytest_configure(config: pytest.Config) -> None:
    """A run ended by SIGTERM (`timeout`, a CI runner's cancel) unwinds as one ended by Ctrl-C
    does: fixtures stop their servers and clusters, atexit hooks remove the session's
    secrets folder (`tests.cluster.cluster_security`), pytest lets go of its temporary
    folder. Ended by the signal's default action, runs left all of them (116 secrets folders
    and 850 MB of locked pytest folders on one machine)."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    if "RAY_TMPDIR" not in os.environ:
        # The Ray clusters tests start (`epd serve`, init_ray; their children inherit it)
        # keep their session folders here, removed after the run, not under /tmp/ray for
        # good (one per run; flaky review, s33). Short: Ray's sockets live under it.
        folder = tempfile.mkdtemp(prefix="epdray-")
        os.environ["RAY_TMPDIR"] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


STRICT_ENV = "EPD_STRICT"
# Dependencies CI must have, as a skip reason names them (lower case).
REQUIRED = ("transformers", "nixl")


def strict() -> bool:
    """Whether skips for want of a `REQUIRED` dependency fail."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def _harden(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Turn `report` into a failure when it is a skip (not an xfail) for want of a
    `REQUIRED` dependency and strict mode is on."""
    if not report.skipped or hasattr(report, "wasxfail") or not strict():
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    missing = next((dep for dep in REQUIRED if dep in reason.lower()), None)
    if missing is None:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{STRICT_ENV}=1: skipped for want of {missing}, which CI must exercise "
        f"(DESIGN: parity with transformers, real NIXL transfers): {reason}"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _harden(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _harden(report)
    return report
