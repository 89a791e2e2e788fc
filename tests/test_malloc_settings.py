"""`tune_malloc`: the process's glibc malloc thresholds, set once, by each engine that runs
forwards on the CPU."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from common.models.malloc_settings import tune_malloc
from encoder_worker import engine as encoder_engine
from encoder_worker.cache import EncoderCache
from encoder_worker.server import load_tower
from encoder_worker.settings import EncoderSettings


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds_and_a_second_call_changes_nothing() -> None:
    assert tune_malloc()
    assert tune_malloc()


def test_the_encoder_engine_tunes_malloc_when_it_starts(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[None] = []

    def record() -> bool:
        calls.append(None)
        return True

    monkeypatch.setattr(encoder_engine, "tune_malloc", record)
    tower = load_tower(ckpt, EncoderSettings())[1]
    encoder_engine.EncoderEngine(tower, EncoderCache(1 << 20))
    assert len(calls) == 1
