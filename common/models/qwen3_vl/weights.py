"""Qwen3-VL checkpoint weights: the expected names and shapes, loading and saving.

A checkpoint folder holds either one `model.safetensors` or shards listed by
`model.safetensors.index.json` (the Hugging Face layout). Tensor names are the reference's
(`transformers.Qwen3VLForConditionalGeneration`): `model.visual.*` for the vision tower,
`model.language_model.*` for the language model and `lm_head.weight` (absent when the word
embeddings are tied).

`load_weights` checks the whole checkpoint against `expected_weight_shapes` from the
safetensors headers alone (no tensor is read for the check) and fails with one error that
names every missing, misshaped or unexpected tensor; only then does it read the tensors the
caller asked for, into memory of their own (never views of the files: they may change
afterwards). `common.models.identity` names what was loaded.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.errors import CheckpointError
from common.models.checkpoint_files import read_checkpoint_object
from common.models.qwen3_vl.config import Qwen3VLConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

VISUAL_PREFIX = "model.visual."
LANGUAGE_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"

# Extra tensors some exporters write that carry no learned state (rotary inverse
# frequencies are recomputed from the config); they are skipped, never an error.
_HARMLESS_EXTRA = re.compile(r"(^|\.)(inv_freq|original_inv_freq)$")


def expected_weight_shapes(config: Qwen3VLConfig) -> dict[str, tuple[int, ...]]:
    """Every learned tensor of the whole model, by its reference name, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    shapes.update(_vision_shapes(config))
    shapes.update(_text_shapes(config))
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.text.vocab_size, config.text.hidden_size)
    return shapes


def _vision_shapes(config: Qwen3VLConfig) -> dict[str, tuple[int, ...]]:
    v = config.vision
    d, ff = v.hidden_size, v.intermediate_size
    merged = d * v.merge_unit
    p = VISUAL_PREFIX
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}patch_embed.proj.weight": (
            d,
            v.in_channels,
            v.temporal_patch_size,
            v.patch_size,
            v.patch_size,
        ),
        f"{p}patch_embed.proj.bias": (d,),
        f"{p}pos_embed.weight": (v.num_position_embeddings, d),
    }
    for i in range(v.depth):
        b = f"{p}blocks.{i}."
        shapes.update(
            {
                f"{b}norm1.weight": (d,),
                f"{b}norm1.bias": (d,),
                f"{b}norm2.weight": (d,),
                f"{b}norm2.bias": (d,),
                f"{b}attn.qkv.weight": (3 * d, d),
                f"{b}attn.qkv.bias": (3 * d,),
                f"{b}attn.proj.weight": (d, d),
                f"{b}attn.proj.bias": (d,),
                f"{b}mlp.linear_fc1.weight": (ff, d),
                f"{b}mlp.linear_fc1.bias": (ff,),
                f"{b}mlp.linear_fc2.weight": (d, ff),
                f"{b}mlp.linear_fc2.bias": (d,),
            }
        )
    mergers = [(f"{p}merger.", d)] + [
        (f"{p}deepstack_merger_list.{i}.", merged) for i in range(len(v.deepstack_visual_indexes))
    ]
    # The final merger normalises each patch before the 2x2 shuffle; deepstack mergers
    # normalise the shuffled row.
    for m, norm_dim in mergers:
        shapes.update(
            {
                f"{m}norm.weight": (norm_dim,),
                f"{m}norm.bias": (norm_dim,),
                f"{m}linear_fc1.weight": (merged, merged),
                f"{m}linear_fc1.bias": (merged,),
                f"{m}linear_fc2.weight": (v.out_hidden_size, merged),
                f"{m}linear_fc2.bias": (v.out_hidden_size,),
            }
        )
    return shapes


def _text_shapes(config: Qwen3VLConfig) -> dict[str, tuple[int, ...]]:
    t = config.text
    d, ff, hd = t.hidden_size, t.intermediate_size, t.head_dim
    q, kv = t.num_attention_heads * hd, t.num_key_value_heads * hd
    p = LANGUAGE_PREFIX
    shapes: dict[str, tuple[int, ...]] = {f"{p}embed_tokens.weight": (t.vocab_size, d)}
    for i in range(t.num_hidden_layers):
        layer = f"{p}layers.{i}."
        shapes.update(
            {
                f"{layer}self_attn.q_proj.weight": (q, d),
                f"{layer}self_attn.k_proj.weight": (kv, d),
                f"{layer}self_attn.v_proj.weight": (kv, d),
                f"{layer}self_attn.o_proj.weight": (d, q),
                f"{layer}self_attn.q_norm.weight": (hd,),
                f"{layer}self_attn.k_norm.weight": (hd,),
                f"{layer}mlp.gate_proj.weight": (ff, d),
                f"{layer}mlp.up_proj.weight": (ff, d),
                f"{layer}mlp.down_proj.weight": (d, ff),
                f"{layer}input_layernorm.weight": (d,),
                f"{layer}post_attention_layernorm.weight": (d,),
            }
        )
        if t.attention_bias:
            shapes.update(
                {
                    f"{layer}self_attn.q_proj.bias": (q,),
                    f"{layer}self_attn.k_proj.bias": (kv,),
                    f"{layer}self_attn.v_proj.bias": (kv,),
                    f"{layer}self_attn.o_proj.bias": (d,),
                }
            )
    shapes[f"{p}norm.weight"] = (d,)
    return shapes


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it (no tensor is read)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = (read_checkpoint_object(index) or {}).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        for file in set(weight_map.values()):
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                raise CheckpointError(f"{index}: weight_map names {file!r}, not a file here")
        files = {name: folder / file for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"{index} lists {path.name}, which does not exist")
        return files
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


# The safetensors dtypes of learned weights (cast to the worker's dtype at load); an integer
# or bool tensor loaded as is and changed the model without a word.
FLOAT_DTYPES = frozenset(("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"))


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape as the safetensors headers state it (no tensor is read); a
    tensor stored as anything but a float is refused, naming it."""
    files = weight_files(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if files.get(name) == path:
                    part = f.get_slice(name)
                    if part.get_dtype() not in FLOAT_DTYPES:
                        raise CheckpointError(
                            f"{path}: tensor {name} is stored as {part.get_dtype()}, not as a "
                            f"float ({', '.join(sorted(FLOAT_DTYPES))})"
                        )
                    shapes[name] = tuple(part.get_shape())
    missing_in_shards = sorted(set(files) - set(shapes))
    if missing_in_shards:
        raise CheckpointError(
            f"index lists tensors absent from their shard: {', '.join(missing_in_shards[:10])}"
        )
    return shapes


def check_checkpoint(folder: str | Path, config: Qwen3VLConfig) -> None:
    """Raise `CheckpointError` naming every missing, misshaped or unexpected tensor."""
    expected = expected_weight_shapes(config)
    found = checkpoint_shapes(folder)
    problems: list[str] = []
    missing = sorted(set(expected) - set(found))
    if missing:
        problems.append(f"missing {len(missing)}: {_some(missing)}")
    misshaped = sorted(
        f"{n} (expected {list(expected[n])}, found {list(found[n])})"
        for n in set(expected) & set(found)
        if expected[n] != found[n]
    )
    if misshaped:
        problems.append(f"misshaped {len(misshaped)}: {_some(misshaped)}")
    unexpected = sorted(n for n in set(found) - set(expected) if not _is_harmless_extra(n, config))
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_some(unexpected)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} does not match its config: " + "; ".join(problems)
        )


def _some(names: list[str], shown: int = 10) -> str:
    """The first `shown` names, and how many more (an FP8 checkpoint's scales made 15 KB)."""
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _is_harmless_extra(name: str, config: Qwen3VLConfig) -> bool:
    # A tied checkpoint may still store lm_head (a copy of the embedding); we use the embedding.
    return bool(_HARMLESS_EXTRA.search(name)) or (config.tie_word_embeddings and name == LM_HEAD)


def load_weights(
    folder: str | Path,
    config: Qwen3VLConfig,
    *,
    dtype: torch.dtype | None = torch.float32,
    prefix: str | Iterable[str] = "",
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Check the whole checkpoint, then read the expected tensors whose names start with `prefix`.

    `prefix` is one prefix or several (e.g. `("model.language_model.", "lm_head.")`); the
    returned names are the full reference names, prefix included. Floating tensors are cast to
    `dtype` (None keeps the stored dtype). Raises `CheckpointError` before reading anything
    when a tensor is missing, misshaped or unexpected.
    """
    check_checkpoint(folder, config)
    prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
    wanted = sorted(n for n in expected_weight_shapes(config) if n.startswith(prefixes))
    files = weight_files(folder)
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    shards = sorted(by_file.items())
    started, nbytes = time.monotonic(), 0
    for done, (path, names) in enumerate(shards, start=1):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in names:
                tensor = f.get_tensor(name)
                target = dtype if dtype is not None else tensor.dtype
                # Owned bytes: on the CPU `get_tensor` is a view of the file's mapping, so a
                # file rewritten in place changed a running worker's weights under its old
                # identity, and one truncated killed it (SIGBUS).
                tensor = tensor.to(target, copy=tensor.device.type == "cpu")
                tensors[name] = tensor
                nbytes += tensor.numel() * tensor.element_size()
        if len(shards) > 1:  # progress for a sharded (large) checkpoint, one line a shard
            logger.info(
                "loading %s: shard %d of %d (%s), %.0f MB in %.1f s",
                folder,
                done,
                len(shards),
                path.name,
                nbytes / 2**20,
                time.monotonic() - started,
            )
    logger.info(
        "loaded %d tensors (prefix %s, %.0f MB) from %s in %.1f s",
        len(tensors),
        prefixes or "''",
        nbytes / 2**20,
        folder,
        time.monotonic() - started,
    )
    return tensors


def save_weights(
    folder: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write tensors as `model.safetensors`, or as shards plus an index past `max_shard_bytes`.

    Names are written in sorted order and shards are filled in that order, so the same
    tensors always give the same bytes. Returns the files written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        path = folder / SINGLE_FILE
        save_file({n: _contiguous(tensors[n]) for n in names}, str(path), metadata=metadata)
        return [path]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        shard_tensors = {n: _contiguous(tensors[n]) for n in shard}
        save_file(shard_tensors, str(folder / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
        written.append(folder / file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    written.append(folder / INDEX_FILE)
    return written


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # safetensors refuses views and shared storage; a detached contiguous copy is always safe.
    return tensor.detach().contiguous().clone()
