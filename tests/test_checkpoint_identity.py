"""A worker computes with the weights its identity names (`common.models.identity`): loaded
weights own their bytes, a checkpoint changed while it loads is refused, the identity
covers which file each tensor comes from, and a weight stored as an integer is refused."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import common.models.identity as identity
from common.errors import CheckpointError
from common.models.identity import load_identified, model_identity
from common.models.qwen3_vl.config import Qwen3VLConfig
from common.models.qwen3_vl.weights import (
    INDEX_FILE,
    SINGLE_FILE,
    load_weights,
    save_weights,
)
from common.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny checkpoints of the same shapes (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("ckpts")
    return make_tiny_checkpoint(root / "a", seed=0), make_tiny_checkpoint(root / "b", seed=1)


def copy_of(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def test_loaded_weights_do_not_follow_the_file(ckpts: tuple[Path, Path], tmp_path: Path) -> None:
    # On the CPU the loaded tensors were views of the file's mapping: `cp new old` over a
    # running worker's checkpoint moved its logits by up to 0.66 under its old identity.
    folder, other = copy_of(ckpts[0], tmp_path / "a"), ckpts[1]
    config = Qwen3VLConfig.from_file(folder)
    tensors = load_weights(folder, config)
    kept = {name: t.clone() for name, t in tensors.items()}
    new = (other / SINGLE_FILE).read_bytes()
    assert len(new) == (folder / SINGLE_FILE).stat().st_size  # rewritten in place, same inode
    with (folder / SINGLE_FILE).open("r+b") as f:
        f.write(new)
    assert all(torch.equal(tensors[name], kept[name]) for name in kept)


def replace_file(target: Path, new: Path) -> None:
    """An update landing whole: a new file renamed over the old one (a new inode)."""
    shutil.copyfile(new, target.with_suffix(".new"))
    os.replace(target.with_suffix(".new"), target)


def rewrite_keeping_mtime(target: Path, new: Path) -> None:
    """`cp -p` over the file: written in place, size, inode and mtime kept."""
    st = target.stat()
    with target.open("r+b") as f:
        f.write(new.read_bytes())
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("change", [replace_file, rewrite_keeping_mtime])
def test_a_checkpoint_changed_while_it_loads_is_refused(
    ckpts: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[Path, Path], None],
) -> None:
    # Changed between the load and the hash, a worker reported the new checkpoint's identity
    # and computed with the old one's weights (`cp -p` keeps the mtime: ctime catches it).
    folder, other = copy_of(ckpts[0], tmp_path / "a"), ckpts[1]
    config = Qwen3VLConfig.from_file(folder)
    load = identity.load_weights

    def load_then_change(*args: Any, **kwargs: Any) -> Any:
        tensors = load(*args, **kwargs)
        change(folder / SINGLE_FILE, other / SINGLE_FILE)
        return tensors

    monkeypatch.setattr(identity, "load_weights", load_then_change)
    with pytest.raises(CheckpointError, match="changed while it was loaded"):
        load_identified(folder, config)
    monkeypatch.undo()
    tensors, name = load_identified(folder, config)  # once complete, it loads
    assert name == model_identity(ckpts[1], config) and tensors


def test_the_identity_of_a_checkpoint_stays_what_it_was() -> None:
    # Routers and workers of two versions must agree on it (a rolling upgrade; a pinned
    # --expected-model): a change to the scheme changes every identity, so it is deliberate.
    from common.models.tiny import default_checkpoint

    folder = default_checkpoint("tiny")
    config = Qwen3VLConfig.from_file(folder)
    assert model_identity(folder, config) == "qwen3-vl/cc9bebb07129822c696ef7c1ccd5077f"


def test_the_identity_covers_which_shard_each_tensor_comes_from(
    ckpts: tuple[Path, Path], tmp_path: Path
) -> None:
    # A shard may hold a second copy of a tensor the index maps elsewhere: two indexes over
    # the same shards loaded different models under one identity.
    config = Qwen3VLConfig.from_file(ckpts[0])
    tensors = load_file(str(ckpts[0] / SINGLE_FILE))
    first = save_weights(tmp_path / "a", tensors, max_shard_bytes=256 * 1024)
    assert len(first) > 3
    index = json.loads((tmp_path / "a" / INDEX_FILE).read_text())
    shards = list(index["weight_map"].values())
    # A tensor of a shard that holds others too: both indexes list the same shards.
    name = next(n for n, f in index["weight_map"].items() if shards.count(f) > 1)
    last = next(p for p in first if p.name != index["weight_map"][name] and p.name in shards)
    extra = load_file(str(last))
    extra[name] = torch.randn_like(tensors[name])
    save_file(extra, str(last), metadata={"format": "pt"})
    other = copy_of(tmp_path / "a", tmp_path / "b")
    index["weight_map"][name] = last.name
    (other / INDEX_FILE).write_text(json.dumps(index))
    assert set(index["weight_map"].values()) == set(shards)  # the same files, mapped anew
    a, b = load_weights(tmp_path / "a", config), load_weights(other, config)
    assert not torch.equal(a[name], b[name])
    assert model_identity(tmp_path / "a", config) != model_identity(other, config)


def test_an_index_naming_a_file_outside_the_folder_is_refused(
    ckpts: tuple[Path, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "a"
    save_weights(folder, load_file(str(ckpts[0] / SINGLE_FILE)), max_shard_bytes=256 * 1024)
    index = json.loads((folder / INDEX_FILE).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../outside.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file here"):
        load_weights(folder, Qwen3VLConfig.from_file(ckpts[0]))


def test_a_weight_stored_as_an_integer_is_refused(ckpts: tuple[Path, Path], tmp_path: Path) -> None:
    # A uint8 final norm loaded as is and answered other text, with no word at start.
    folder = copy_of(ckpts[0], tmp_path / "a")
    tensors = load_file(str(folder / SINGLE_FILE))
    norm = "model.language_model.norm.weight"
    tensors[norm] = tensors[norm].to(torch.uint8)
    save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=re.escape(f"tensor {norm} is stored as U8, not as a float")
    ):
        load_weights(folder, Qwen3VLConfig.from_file(folder))


async def test_a_router_refuses_weights_no_worker_can_load(
    ckpts: tuple[Path, Path], tmp_path: Path
) -> None:
    # It hashed them and started; every worker refused them, and a router nothing restarts
    # (Kubernetes) answered UNAVAILABLE for good.
    from router.server import serve
    from router.settings import RouterSettings
    from tests.cluster import cluster_security

    folder = copy_of(ckpts[0], tmp_path / "a")
    tensors = load_file(str(folder / SINGLE_FILE))
    del tensors["model.language_model.norm.weight"]
    save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    settings = RouterSettings(model=str(folder), port=0, http_port=-1, security=cluster_security())
    with pytest.raises(CheckpointError, match=r"missing 1: model\.language_model\.norm\.weight"):
        await serve(settings)


async def test_a_router_told_the_model_needs_no_weights(
    ckpts: tuple[Path, Path], tmp_path: Path
) -> None:
    # With --expected-model the router reads only the tokenizer and config (deploy/README):
    # the weights' check refused such a folder, and the router restarted in a loop.
    from router.server import serve
    from router.settings import RouterSettings
    from tests.cluster import cluster_security

    folder = copy_of(ckpts[0], tmp_path / "a")
    (folder / SINGLE_FILE).unlink()
    settings = RouterSettings(
        model=str(folder),
        expected_model="qwen3-vl/x",
        port=0,
        http_port=-1,  # not the default 8000: another server may hold it
        security=cluster_security(),
    )
    router = await serve(settings)
    await router.stop(0)
