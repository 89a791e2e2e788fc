"""Elementwise helpers of the text model (`text.TextModel`; the vision tower rotates with
`rotate` too), kept to the reference's arithmetic in as few ops as that allows. On the CPU
`rms_norm`, `norm_rotate` and `silu_mul` are one call each to the C kernels of
`common.models.native_kernels` where those are built, and torch's ops otherwise.
Projections are in `linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.models.native_kernels import native_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's RMSNorm over the last dimension (normalize in float32, cast, then
    scale by `weight`, which broadcasts over `x`'s trailing dimensions).

    On the CPU (float32 or bfloat16) it is the C kernel of `common.models.native_kernels`
    where that is built: one call for what torch runs as five ops (11 against 25 us on a
    row of 256), the same to float rounding. Otherwise, in float32 the cast is a no-op, so
    it is the reference's own ops in place where they can be: the same bits as the
    reference and as `F.rms_norm`, and at prefill's row counts a third faster than the
    latter."""
    kernels = native_kernels()
    if kernels is not None and kernels.rms_norm_takes(x, weight):
        return kernels.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        scale = torch.mean(x * x, -1, keepdim=True).add_(eps).rsqrt_()
        return (x * scale).mul_(weight)
    shape = (x.shape[-1],)
    return weight * F.rms_norm(x.to(torch.float32), shape, eps=eps).to(x.dtype)


def norm_rotate(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """`rotate(rms_norm(x, weight, eps), cos, signed_sin)`: the q/k heads' norm and RoPE, in
    one pass of the C kernel where it takes them (on the CPU; the same to rounding)."""
    kernels = native_kernels()
    if kernels is not None and kernels.rms_norm_rotate_takes(x, weight, cos, signed_sin):
        return kernels.rms_norm_rotate(x, weight, eps, cos, signed_sin)
    return rotate(rms_norm(x, weight, eps), cos, signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up [n, 2f]` (gate its first f columns), `[n, f]`: one pass
    of the C kernel where it takes it (on the CPU; the same to rounding), else
    torch's two ops in place (`gate_up` is then overwritten)."""
    kernels = native_kernels()
    if kernels is not None and kernels.silu_mul_takes(gate_up):
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


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
