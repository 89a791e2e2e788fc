"""Elementwise and projection helpers of the text model (`text.TextModel`; the vision
tower rotates with `rotate` too), kept to the reference's arithmetic in as few ops as that
allows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's RMSNorm over the last dimension (normalize in float32, cast, then
    scale by `weight`, which broadcasts over `x`'s trailing dimensions).

    In float32 the cast is a no-op, so it is the reference's own ops in place where they
    can be: the same bits as the reference and as `F.rms_norm`, and at prefill's row counts
    a third faster than the latter (decode's: the same)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        scale = torch.mean(x * x, -1, keepdim=True).add_(eps).rsqrt_()
        return (x * scale).mul_(weight)
    shape = (x.shape[-1],)
    return weight * F.rms_norm(x.to(torch.float32), shape, eps=eps).to(x.dtype)


def dense(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [n, in] @ weight_t [in, out] (+ bias)`: a linear layer with a transposed weight."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def transposed(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed form of a float32 CPU `[out, in]` weight (None where oneDNN or its
    packing op is not there)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True, slots=True)
class Dense:
    """A linear layer `x [n, in] -> [n, out]`, by the kernel that is fastest at `n` rows.

    One row (a batch-1 decode step, the last layer's row of one prompt): a GEMM against the
    weight stored transposed (`weight_t`, `[in, out]`), MKL's matrix-vector kernel. Two rows
    or more, with `packed` (CPU, float32, oneDNN there): oneDNN's linear on the weight
    packed once at load, which on this project's 2-core machines is 1.2-2x faster than that
    GEMM at 2-32 rows (decode batches) and about 1.1x at prefill's hundreds, and rounds each
    row alike whatever the row count; at one row it is slower, hence both. The packed copy
    doubles the projection's memory (`packed_weights` False: one copy, the GEMM at every
    row count).
    """

    weight_t: torch.Tensor  # [in, out], contiguous
    bias: torch.Tensor | None
    packed: torch.Tensor | None  # oneDNN's packed [out, in] weight, or None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, packed: bool) -> Dense:
        """From a checkpoint's `[out, in]` weight (and `[out]` bias); `packed`: also keep the
        oneDNN copy where it can be made."""
        return cls(transposed(weight), bias, _onednn_packed(weight) if packed else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] > 1:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return dense(x, self.weight_t, self.bias)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`sin` with its first half negated, for `rotate` (once per forward)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The reference's `x * cos + rotate_half(x) * sin`, with `rotate_half(x) = cat(-x2, x1)`
    taken as `roll(x, half) * signed_sin`: `-x2 * s1 == x2 * -s1` exactly, in fewer ops."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def length_mask(seq_lens: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """`[B, 1, 1, span]` attention bias in `dtype`: 0 at positions below each sequence's
    length, -inf past it (what attention makes of the boolean mask, made once a step)."""
    keep = torch.arange(span, device=seq_lens.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    return additive(keep, dtype).view(-1, 1, 1, span)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias `scaled_dot_product_attention` makes of a boolean `mask` on every call: 0
    where True, -inf where False, in `dtype` (the queries'); made once, it serves every
    layer's call with the same results."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(mask.logical_not(), float("-inf"))
