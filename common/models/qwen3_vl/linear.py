"""The models' linear layers, by the kernel fastest at the rows they get.

`Dense` (the text model's projections, weights fused and transposed at load) and
`PackedLinear` (the vision tower's `nn.Linear`s, swapped in by `pack_linears`): torch's
GEMM, or, where packing is on, oneDNN's linear on the weight packed once at load (CPU,
float32 or bfloat16, a torch with oneDNN). In float32 one row stays on MKL's GEMM (faster
there) and the packed kernel takes two or more; in bfloat16 it takes every row count. A
packed row rounds alike whatever the row count (in float32, from two rows up: oneDNN's
one-row kernel rounds otherwise). The packed copy doubles the weights' memory.

Which kernel is faster depends on the CPU and the dtype (`packing_pays`), measured per call
on the project's 2-core machines, one thread:
- float32, AMD EPYC (AVX-512): MKL takes generic paths on a CPU that is not Intel's, and
  oneDNN is 1.4-1.9x faster at 5-32 rows (decode batches), 1.0-1.4x at the vision tower's
  49-784 and about 1.1x at prefill's hundreds; slower at one row.
- float32, Intel Xeon (AVX-512, AMX): MKL is faster at 1-32 rows (1.1-5x: oneDNN spends
  ~15 us a call), level from 128; a batch-4 decode step is 1.3x slower packed.
- bfloat16, Intel Xeon with AMX: packed is 1.6-2.4x faster than torch's bfloat16 GEMM at
  1-32 rows (which is no faster than float32 at one row).
- bfloat16, AMD EPYC with `avx512_bf16` (Zen 4), whole engine: packed decode steps 1.17-1.56x
  faster at batch 1-4, prefill and the vision tower 1.04-1.05x.
So the `packed_weights` setting unset (None) packs where `packing_pays`; true or false
decides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.cpu import cpu_info

PACKABLE = (torch.float32, torch.bfloat16)  # the dtypes `onednn_packed` packs


def dense(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [n, in] @ weight_t [in, out] (+ bias)`: a linear layer with a transposed weight."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def transposed(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()


@functools.cache
def packing_pays(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's packed linear is the faster kernel here for `dtype` (module
    docstring): float32 where torch's GEMM is MKL on an x86 CPU that is not Intel's;
    bfloat16 where the CPU computes it natively (`avx512_bf16` or AMX's `amx_bf16`).
    Unmeasured cases (ARM, no cpuinfo, other dtypes) keep torch's GEMM."""
    if not torch.backends.mkldnn.is_available():
        return False
    vendor, flags = cpu_info()
    if dtype == torch.float32:
        return torch.backends.mkl.is_available() and vendor not in ("", "GenuineIntel")
    if dtype == torch.bfloat16:
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def use_packed(packed_weights: bool | None, dtype: torch.dtype) -> bool:
    """The `packed_weights` setting resolved for weights of `dtype`: unset (None) is
    `packing_pays(dtype)`."""
    return packing_pays(dtype) if packed_weights is None else packed_weights


def packed_from_rows(dtype: torch.dtype) -> int:
    """The fewest rows that go to the packed kernel: in float32 one row is faster on MKL's
    matrix-vector GEMM; in bfloat16 the packed kernel is faster at every row count."""
    return 2 if dtype == torch.float32 else 1


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed form of a float32 or bfloat16 CPU `[out, in]` weight (None where
    oneDNN or its packing op is not there, or for another dtype or device)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (AttributeError, RuntimeError):
        return None


# Rows oneDNN is given as they are; past them, padded up to one of 2**ROW_BUCKETS_LOG2 sizes
# per power of two (at most 1/16 more rows), and past `CHUNK_ROWS`, computed that many at a
# time. oneDNN makes a primitive per row count and keeps it (ideep's per-thread cache and its
# own, 1024 each, ~0.3-0.8 MB a primitive): a prefill worker's row counts are its prompts'
# lengths, and every new one held ~0.5 GB more until both caches were full, then churned
# them, leaving up to 2 GB of freed heap resident (memgrow review, s38). Now 144 row counts
# at most, whatever the lengths; decode batches (`max_batch` 32) stay exact.
EXACT_ROWS = 64
ROW_BUCKETS_LOG2 = 4
CHUNK_ROWS = 2048


def bucket_rows(rows: int) -> int:
    """The row count oneDNN computes `rows` rows (at most `CHUNK_ROWS`) at."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 1 - ROW_BUCKETS_LOG2)  # 1/16 of its power of two
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [n, in] @ W.T (+ bias)` by oneDNN, `packed` being `onednn_packed(W)`, at the row
    counts the comment above says (a packed row rounds alike whatever the row count, from
    two rows on: the same values as one call)."""
    assert x.dim() == 2, "onednn_linear takes [rows, in]"  # padding and chunks are by row
    rows = x.shape[0]
    if rows <= CHUNK_ROWS:
        return _bucketed(x, packed, bias)
    # Into one output (a cat of the pieces held it twice); a one-row tail at two rows, as in
    # float32 oneDNN's one-row kernel rounds otherwise (s38diff review).
    first = _bucketed(x[:CHUNK_ROWS], packed, bias)
    out = first.new_empty(rows, first.shape[1])
    out[:CHUNK_ROWS] = first
    del first
    for i in range(CHUNK_ROWS, rows, CHUNK_ROWS):
        out[i : i + CHUNK_ROWS] = _bucketed(x[i : i + CHUNK_ROWS], packed, bias, at_least=2)
    return out


def _bucketed(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, at_least: int = 1
) -> torch.Tensor:
    """oneDNN's linear over `x`'s rows (at most `CHUNK_ROWS`), padded to `bucket_rows` and
    to `at_least` rows."""
    rows = x.shape[0]
    padded = max(bucket_rows(rows), at_least)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if padded == rows else out[:rows]


@dataclass(frozen=True, slots=True)
class Dense:
    """A linear layer `x [n, in] -> [n, out]` (module docstring): a GEMM against the weight
    stored transposed (`weight_t`, `[in, out]`: MKL's matrix-vector kernel at one row), or
    oneDNN with `packed`, where it was made, from `from_rows` rows on."""

    weight_t: torch.Tensor  # [in, out], contiguous
    bias: torch.Tensor | None
    packed: torch.Tensor | None  # oneDNN's packed [out, in] weight, or None
    from_rows: int = 2  # the fewest rows `packed` takes (`packed_from_rows`)

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, packed: bool) -> Dense:
        """From a checkpoint's `[out, in]` weight (and `[out]` bias); `packed`: also keep the
        oneDNN copy where it can be made."""
        copy = onednn_packed(weight) if packed else None
        return cls(transposed(weight), bias, copy, packed_from_rows(weight.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] >= self.from_rows:
            return onednn_linear(x, self.packed, self.bias)
        return dense(x, self.weight_t, self.bias)


class PackedLinear(nn.Linear):
    """An `nn.Linear` that, given 2-D input of at least `from_rows` rows, runs oneDNN's
    linear on `packed` (its weight packed at load); its parameters and state dict are the
    `nn.Linear`'s."""

    packed: torch.Tensor
    from_rows: int

    @classmethod
    def of(cls, linear: nn.Linear, packed: torch.Tensor) -> PackedLinear:
        """`linear`'s parameters (shared, not copied), with their packed copy."""
        new = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta"
        )
        new.weight, new.bias = linear.weight, linear.bias
        new.packed = packed
        new.from_rows = packed_from_rows(linear.weight.dtype)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] >= self.from_rows:
            return onednn_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(module: nn.Module) -> int:
    """Swap every `nn.Linear` inside `module` for a `PackedLinear` where its weight can be
    packed (CPU, float32 or bfloat16, oneDNN); the number swapped. Call it once the weights
    are loaded and on their device: later changes to a weight do not reach its packed copy."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = onednn_packed(child.weight.detach())
                if packed is not None:
                    setattr(parent, name, PackedLinear.of(child, packed))
                    swapped += 1
    return swapped
