"""A test run ended by SIGTERM unwinds (tests/conftest.py's `pytest_configure`): fixtures tear
down and atexit hooks run, so nothing a session made (a cluster's processes, its secrets
folder) outlives it."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

TESTS = """
import atexit, os, shutil, signal, tempfile
from pathlib import Path

import pytest

FOLDER = Path(tempfile.mkdtemp(prefix="epd-signal-test-"))
atexit.register(shutil.rmtree, FOLDER, ignore_errors=True)
Path(os.environ["REPORT"]).write_text(str(FOLDER) + "\\n")

@pytest.fixture
def server():
    yield
    with open(os.environ["REPORT"], "a") as out:
        out.write("torn down\\n")

def test_ended_by_a_signal(server):
    os.kill(os.getpid(), signal.SIGTERM)

def test_never_run():
    pass
"""


def test_a_run_ended_by_sigterm_tears_down_and_cleans_up(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytester.makeconftest(CONFTEST.read_text().replace('pytest_plugins = ("pytester",)', ""))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_signal=TESTS)
    report = tmp_path / "report"
    monkeypatch.setenv("REPORT", str(report))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    folder, *rest = report.read_text().splitlines()
    assert rest == ["torn down"]
    assert not Path(folder).exists()
