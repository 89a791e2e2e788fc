"""`common.models.qwen3_vl.linear`: the text model's `Dense` and the vision tower's
`PackedLinear`. At one row torch's GEMM (the same bits as before packing), at two or more
oneDNN's linear on the packed weight (where it can be made: CPU, float32; in bfloat16 from
one row on). Both compute
`x @ W.T + b` to float rounding at every row count, for contiguous and strided rows; a
packed row rounds alike whatever the row count, so a sequence decoded with others gets the
same bits as with any other batch of two or more. `packed=False` (the `packed_weights`
setting off) keeps one copy; `pack_linears` keeps a module's parameters and state dict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.cpu import cpu_info
from common.models.qwen3_vl import linear
from common.models.qwen3_vl.linear import (
    Dense,
    PackedLinear,
    dense,
    onednn_packed,
    pack_linears,
)

TOL = 1e-4

onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
# oneDNN packs bfloat16 weights only on a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT.
BF16_PACKS = onednn_packed(torch.zeros(8, 8, dtype=torch.bfloat16)) is not None


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


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_past_64_are_computed_padded_to_a_bucket_and_in_chunks_with_the_same_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # oneDNN keeps a primitive per row count: a prefill worker's prompts of every length
    # held ~0.5 GB of them, and churned up to 2 GB of heap (memgrow review, s38).
    if dtype == torch.bfloat16 and not BF16_PACKS:
        pytest.skip("oneDNN packs no bfloat16 weights on this CPU")
    # A wide input: at 128 a float32 one-row chunk tail (2049 rows) rounded alike by chance.
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(192, 2048, generator=gen).to(dtype)
    packed = onednn_packed(weight)
    assert packed is not None
    x = torch.randn(5000, 2048, generator=gen).to(dtype)
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, *args)

    with torch.inference_mode():
        rows_tried = (2, 64, 65, 100, 300, 700, 2049, 5000)
        wants = [real(x[:rows], packed, None, "none", [], "") for rows in rows_tried]
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
        for rows, want in zip(rows_tried, wants, strict=True):
            got = linear.onednn_linear(x[:rows], packed, None)
            assert got.shape == (rows, 192) and torch.equal(got, want), rows
    # 2049: a one-row tail computed at two rows; 5000: 2048 at a time
    assert seen == [2, 64, 68, 100, 304, 704, 2048, 2, 2048, 2048, 928]


def test_row_buckets_are_few_and_close() -> None:
    buckets = {linear.bucket_rows(rows) for rows in range(1, linear.CHUNK_ROWS + 1)}
    assert len(buckets) == 64 + 5 * 16  # exact to 64, then 16 per power of two to 2048
    for rows in range(1, linear.CHUNK_ROWS + 1):
        padded = linear.bucket_rows(rows)
        assert rows <= padded <= rows * 17 / 16 and (rows > 64 or padded == rows)


def test_one_copy_without_packing_or_where_it_cannot_be_made() -> None:
    weight = torch.randn(64, 32)
    x = torch.randn(5, 32)
    plain = Dense.of(weight, packed=False)
    assert plain.packed is None
    assert torch.equal(plain(x), dense(x, plain.weight_t, None))
    half = Dense.of(weight.to(torch.float16), packed=True)  # float32 and bfloat16 only
    assert half.packed is None
    assert half(x.to(torch.float16)).dtype == torch.float16


@onednn
@pytest.mark.parametrize("rows", [1, 2, 7, 32])
def test_bfloat16_packs_and_takes_every_row_count(rows: int) -> None:
    """In bfloat16 the packed kernel serves one row too (`packed_from_rows`), and rounds
    like torch's bfloat16 linear to bfloat16's precision; its rows round alike at any row
    count. On a CPU where oneDNN cannot pack bfloat16, the layer keeps one copy and still
    computes the map."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(384, 256, generator=gen).to(torch.bfloat16)
    b = torch.randn(384, generator=gen).to(torch.bfloat16)
    layer = Dense.of(weight, b, packed=True)
    if BF16_PACKS:
        assert layer.packed is not None and layer.from_rows == 1
    else:
        assert layer.packed is None
    x = torch.randn(32, 256, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x[:rows])
        want = x[:rows].double() @ weight.double().t() + b.double()
        assert got.dtype == torch.bfloat16
        assert ((got.double() - want).abs() / (want.abs() + 1.0)).max().item() <= 2e-2
        if BF16_PACKS:
            assert torch.equal(layer(x)[:rows], got)


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
    module = nn.Sequential(nn.Linear(8, 8)).to(torch.float16)
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
def test_cpu_info_reads_the_vendor_line(tmp_path, text: str, vendor: str) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert cpu_info(path)[0] == vendor
    assert cpu_info(tmp_path / "absent") == ("", frozenset())


def test_cpu_info_reads_the_first_processors_flags(tmp_path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx512f amx_bf16\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu\n"
    )
    assert cpu_info(path) == ("GenuineIntel", frozenset({"fpu", "avx512f", "amx_bf16"}))


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
    monkeypatch.setattr(linear, "cpu_info", lambda: (vendor, frozenset({"avx512f"})))
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    linear.packing_pays.cache_clear()
    try:
        assert linear.packing_pays() is pays
        assert linear.use_packed(None, torch.float32) is pays
        assert linear.use_packed(True, torch.float32)
        assert not linear.use_packed(False, torch.float32)
        assert not linear.use_packed(None, torch.bfloat16)  # no bfloat16 instructions
    finally:
        linear.packing_pays.cache_clear()


@pytest.mark.parametrize(
    ("flags", "pays"),
    [({"avx512f", "amx_bf16"}, True), ({"avx512_bf16"}, True), ({"avx512f"}, False)],
)
def test_bfloat16_packing_pays_where_the_cpu_computes_it(monkeypatch, flags, pays) -> None:
    """bfloat16 packs where the CPU has bfloat16 instructions (AMX or AVX-512 BF16: oneDNN
    1.6-2.4x faster than torch's bfloat16 GEMM at 1-32 rows), whoever made it; float16
    never (unmeasured)."""
    monkeypatch.setattr(linear, "cpu_info", lambda: ("GenuineIntel", frozenset(flags)))
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    linear.packing_pays.cache_clear()
    try:
        assert linear.packing_pays(torch.bfloat16) is pays
        assert not linear.packing_pays(torch.float16)
    finally:
        linear.packing_pays.cache_clear()
