"""`tune_malloc`: the process's glibc malloc thresholds, set once."""

from __future__ import annotations

import platform

import pytest

from common.models.malloc_settings import tune_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds_and_a_second_call_changes_nothing() -> None:
    assert tune_malloc()
    assert tune_malloc()
