"""`common.models.qwen3_vl.linear`: the text model's `Dense` and the vision tower's
`PackedLinear`. At one row torch's GEMM (the same bits as before packing), at two or more
oneDNN's linear on the packed weight (where it can be made: CPU, float32). Both compute
`x @ W.T + b` to float rounding at every row count, for contiguous and strided rows; a
packed row rounds alike whatever the row count, so a sequence decoded with others gets the
same bits as with any other batch of two or more. `packed=False` (the `packed_weights`
setting off) keeps one copy; `pack_linears` keeps a module's parameters and state dict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.models.qwen3_vl import linear
from common.models.qwen3_vl.linear import Dense, PackedLinear, _cpu_vendor, dense, pack_linears

TOL = 1e-4

onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 32, 300])
def test_equals_the_linear_map(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(384, 256, generator=gen)
    b = torch.randn(384, generator=gen) if bias else None
    layer = Dense.of(weight, b, packed=True)
    assert layer.packed is not None
    x = torch.randn(rows, 256, generator=gen)
    want = x.double() @ weight.double().t() + (0 if b is None else b.double())
    with torch.inference_mode():
        got = layer(x)
        strided = layer(torch.cat((x, x), dim=1)[:, :256])  # rows with a stride of 512
    assert got.shape == (rows, 384)
    assert (got.double() - want).abs().max().item() <= TOL
    assert torch.equal(strided, got)
    if rows == 1:  # one row: the matrix-vector GEMM, as without the packed copy
        assert torch.equal(got, dense(x, layer.weight_t, b))


@onednn
def test_packed_rows_round_alike_at_any_row_count() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Dense.of(torch.randn(512, 256, generator=gen), packed=True)
    x = torch.randn(64, 256, generator=gen)
    with torch.inference_mode():
        first = layer(x[:2])[:2]
        for rows in (3, 5, 8, 17, 64):
            assert torch.equal(layer(x[:rows])[:2], first)


def test_one_copy_without_packing_or_where_it_cannot_be_made() -> None:
    weight = torch.randn(64, 32)
    x = torch.randn(5, 32)
    plain = Dense.of(weight, packed=False)
    assert plain.packed is None
    assert torch.equal(plain(x), dense(x, plain.weight_t, None))
    half = Dense.of(weight.to(torch.bfloat16), packed=True)  # oneDNN's fp32 path only
    assert half.packed is None
    assert half(x.to(torch.bfloat16)).dtype == torch.bfloat16


@onednn
def test_pack_linears_swaps_every_linear_and_keeps_its_parameters() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(96, 32))
    module = nn.Sequential(nn.Linear(64, 96), nn.GELU(), inner)
    keys = list(module.state_dict())
    params = list(module.parameters())
    assert pack_linears(module) == 2
    assert isinstance(module[0], PackedLinear) and isinstance(inner[0], PackedLinear)
    assert list(module.state_dict()) == keys
    assert all(a is b for a, b in zip(module.parameters(), params, strict=True))
    with torch.inference_mode():
        for rows in (1, 2, 49, 196):
            x = torch.randn(rows, 64)
            want = F.linear(F.gelu(F.linear(x, params[0], params[1])), params[2], params[3])
            got = module(x)
            assert (got - want).abs().max().item() <= TOL
            if rows == 1:
                assert torch.equal(got, want)


def test_pack_linears_leaves_what_cannot_be_packed() -> None:
    module = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_linears(module) == 0
    assert type(module[0]) is nn.Linear


@pytest.mark.parametrize(
    ("text", "vendor"),
    [
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n", "AuthenticAMD"),
        ("processor\t: 0\nvendor_id\t: GenuineIntel\n\nprocessor\t: 1\n", "GenuineIntel"),
        ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n", ""),  # ARM
    ],
)
def test_cpu_vendor_reads_the_vendor_line(tmp_path, text: str, vendor: str) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert _cpu_vendor(path) == vendor
    assert _cpu_vendor(tmp_path / "absent") == ""


@pytest.mark.parametrize(
    ("vendor", "mkl", "pays"),
    [
        ("AuthenticAMD", True, True),
        ("GenuineIntel", True, False),
        ("", True, False),
        ("AuthenticAMD", False, False),
    ],
)
def test_packing_pays_where_mkl_runs_on_a_cpu_not_intels(monkeypatch, vendor, mkl, pays) -> None:
    """Unset `packed_weights` packs on AMD (MKL's generic paths: oneDNN 1.4-1.9x faster at
    decode batches) and not on Intel (MKL faster at 1-32 rows) nor where unmeasured."""
    monkeypatch.setattr(linear, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    linear.packing_pays.cache_clear()
    try:
        assert linear.packing_pays() is pays
        assert linear.use_packed(None) is pays
        assert linear.use_packed(True) and not linear.use_packed(False)
    finally:
        linear.packing_pays.cache_clear()
