"""The C kernels' build (`common.models.native_kernels`): cached by source and flags,
concurrent first builds agreeing, the fallback when nothing can be built, and turned off."""

from __future__ import annotations

import concurrent.futures
import logging
from pathlib import Path

import pytest
import torch

from common.models import native_kernels as native
from common.models.native_kernels import NativeKernels, native_kernels
from common.models.qwen3_vl.attention import DecodeAttention
from tests.test_native_kernels import kernel as kernel  # fixture: skips without a compiler


def test_the_build_is_cached_by_source_and_flags(kernel: NativeKernels, tmp_path: Path) -> None:
    # A small source builds as the kernels' does, in a fraction of the time.
    source = tmp_path / "src" / "cpu_kernels.c"
    source.parent.mkdir()
    source.write_text("int epd_one(void) { return 1; }\n")
    header = tmp_path / "src" / "body.h"
    header.write_text("/* included */\n")
    cache = tmp_path / "cache"
    first = native._build(source, cache, (header,))
    assert first is not None and first.is_file()
    assert native._build(source, cache, (header,)) == first  # reused
    header.write_text("/* included, changed */\n")  # an included file is part of the key
    other = native._build(source, cache, (header,))
    source.write_text("int epd_one(void) { return 2; }\n")
    third = native._build(source, cache, (header,))
    assert other is not None and third is not None and len({first, other, third}) == 3
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [first.name, other.name, third.name]
    )  # no temporary files left


def test_no_compiler_or_a_failed_build_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "cpu_kernels.c"
    broken.write_text("this is not C")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native._build(broken, tmp_path / "cache") is None
    assert "building cpu_kernels.c failed" in caplog.text
    assert not any((tmp_path / "cache").iterdir())  # the failed output was removed
    assert native._build(tmp_path / "missing.c", tmp_path / "cache") is None
    unwritable = tmp_path / "file"
    unwritable.write_text("a file where the cache folder would be")
    assert native._build(native.SOURCE, unwritable / "kernels") is None
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    assert native._build(native.SOURCE, tmp_path / "cache") is None


def test_concurrent_first_builds_agree(kernel: NativeKernels, tmp_path: Path) -> None:
    """Workers starting together on an empty cache each build (three compilers at once here:
    the race is in the file system, threads or processes alike); one rename wins, every one
    gets a whole library and no temporary file is left."""
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: native._build(native.SOURCE, tmp_path), range(3)))
    assert len(set(paths)) == 1 and paths[0] is not None
    assert [p.name for p in tmp_path.iterdir()] == [Path(paths[0]).name]
    assert NativeKernels(Path(paths[0])).library == Path(paths[0])  # loads


def test_the_kernel_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_NATIVE_KERNELS", "0")
    native_kernels.cache_clear()
    try:
        assert native_kernels() is None
        plan = DecodeAttention(torch.tensor([2, 3]), [2, 3], 3, torch.float32)
        assert plan.kernels is None and plan.mask is not None
    finally:
        monkeypatch.delenv("EPD_NATIVE_KERNELS")
        native_kernels.cache_clear()
