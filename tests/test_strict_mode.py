"""Strict mode (tests/conftest.py): under EPD_STRICT=1 a skip for want of transformers or
NIXL fails, naming the reason; other skips, and every skip without it, stay skips."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

TESTS = """
import pytest

def test_nixl():
    pytest.skip("NIXL unavailable: NIXL is not installed")

def test_other():
    pytest.skip("needs Linux /proc")

@pytest.mark.xfail(reason="nixl known bug")
def test_xfail():
    raise AssertionError
"""

MODULE_SKIP = """
import pytest

transformers = pytest.importorskip("transformers_absent_for_this_test")

def test_parity():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    # The hooks without the pytester plugin line (the inner run needs no plugin).
    source = CONFTEST.read_text().replace('pytest_plugins = ("pytester",)', "")
    pytester.makeconftest(source)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_runtime=TESTS)
    return pytester


def test_without_strict_mode_everything_skips(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPD_STRICT", raising=False)
    suite.makepyfile(test_module=MODULE_SKIP)
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=3, xfailed=1)


def test_strict_mode_fails_skips_for_want_of_nixl(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPD_STRICT", "1")
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines(["*EPD_STRICT=1: skipped for want of nixl*NIXL unavailable*"])


def test_strict_mode_fails_a_module_skipped_for_want_of_transformers(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPD_STRICT", "1")
    suite.makepyfile(test_module=MODULE_SKIP)
    result = suite.runpytest("-p", "no:cacheprovider")
    assert result.ret != 0
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*skipped for want of transformers*transformers_absent*"])
