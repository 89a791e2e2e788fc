"""The prefill worker's settings: flags and a config file parse into `PrefillSettings`,
`--help` lists the flags, and an unknown dtype is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.settings.security import SecuritySettings
from prefill_worker.__main__ import parse
from prefill_worker.settings import PrefillSettings


async def test_flags_and_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "prefill.toml"
    config.write_text(
        'block_size = 8\nlease_ttl_s = 2.5\nrouter_address = "127.0.0.1:9"\n'
        '[security]\ncluster_token_file = "/run/epd/token"\n'
    )
    settings = parse(["--config", str(config), "--port", "5555", "--prefill-chunk", "64"])
    assert settings == PrefillSettings(
        block_size=8,
        lease_ttl_s=2.5,
        router_address="127.0.0.1:9",
        port=5555,
        prefill_chunk=64,
        security=SecuritySettings(cluster_token_file="/run/epd/token"),
    )
    with pytest.raises(SystemExit) as done:
        parse(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--lease-ttl-s", "--router-address", "--num-blocks", "--config"):
        assert flag in out


async def test_unknown_dtype_is_an_error() -> None:
    with pytest.raises(ValueError, match="dtype"):
        _ = PrefillSettings(dtype="int4").torch_dtype
