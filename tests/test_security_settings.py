"""The `[security]` table: the cluster token file, `--insecure`, and `epd serve` making a
token per deployment."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from cluster.serve import with_cluster_token
from cluster.settings import EpdSettings
from common.settings.schema import SettingsError, from_mapping
from common.settings.security import SecuritySettings, write_token_file
from decode_worker.settings import DecodeSettings
from prefill_worker.__main__ import parse


def test_key_comes_from_the_token_file_and_is_stable(tmp_path: Path) -> None:
    token = write_token_file(tmp_path / "token")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    settings = SecuritySettings(cluster_token_file=str(token))
    key = settings.cluster_key()
    assert key is not None and len(key) == 32
    assert settings.cluster_key() == key
    other = write_token_file(tmp_path / "other")
    assert SecuritySettings(cluster_token_file=str(other)).cluster_key() != key


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), ("short", "under 16 bytes"), ("x" * 5000, "larger than")],
)
def test_bad_token_files_name_the_setting(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SettingsError, match=message) as info:
        SecuritySettings(cluster_token_file=str(path)).cluster_key()
    assert "security.cluster_token_file" in str(info.value)


def test_a_kv_worker_without_a_token_refuses_unless_insecure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(SettingsError, match=r"security\.cluster_token_file"):
        DecodeSettings().check()
    with pytest.raises(SystemExit):
        parse([])
    insecure = parse(["--insecure"])
    assert insecure.security.insecure
    with caplog.at_level(logging.WARNING):
        assert insecure.security.cluster_key("prefill worker") is None
    assert "INSECURE" in caplog.text and "prefill worker" in caplog.text


def test_top_level_security_reaches_every_role(tmp_path: Path) -> None:
    token = str(tmp_path / "token")
    settings = from_mapping(EpdSettings, {"security": {"cluster_token_file": token}})
    for role in settings.role_settings().values():
        assert role.security.cluster_token_file == token
    own = from_mapping(EpdSettings, {"prefill": {"security": {"insecure": True}}})
    assert own.role_settings()["prefill"].security.insecure  # a role's own table, when unset


def test_epd_serve_makes_a_token_per_deployment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    settings = with_cluster_token(EpdSettings())
    path = Path(str(settings.security.cluster_token_file))
    assert path == tmp_path / "epd" / "cluster_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert settings.role_settings()["decode"].security.cluster_key() is not None
    # Given one, or told to run insecure, it makes none.
    given = EpdSettings(security=SecuritySettings(cluster_token_file="/run/token"))
    assert with_cluster_token(given) is given
    insecure = EpdSettings(security=SecuritySettings(insecure=True))
    assert with_cluster_token(insecure) is insecure
