"""Every numeric setting's bounds, checked before a role starts: negative, NaN, past what
gRPC, torch or a C long take, and router limits whose 0 refuses every request of its kind
(each once started and failed, or refused all, naming no setting)."""

from __future__ import annotations

from typing import Any

import pytest

MEANS_SOMETHING_AT_MINUS_1 = {("RouterSettings", "http_port")}  # -1: no HTTP API


@pytest.mark.parametrize("role", ["router", "encoder", "prefill", "decode"])
def test_every_numeric_setting_refuses_negative_nan_and_overflow(role: str) -> None:
    # A negative request_timeout_s failed every request DEADLINE_EXCEEDED, prefill_chunk 0
    # every request INVALID_ARGUMENT (blamed on the client), and NaN passed every `< 0`.
    import dataclasses

    from common.models.tiny import default_checkpoint
    from common.settings.schema import SettingsError
    from common.settings.security import SecuritySettings
    from decode_worker.settings import DecodeSettings
    from encoder_worker.settings import EncoderSettings
    from prefill_worker.settings import PrefillSettings
    from router.settings import RouterSettings

    cls = {
        "router": RouterSettings,
        "encoder": EncoderSettings,
        "prefill": PrefillSettings,
        "decode": DecodeSettings,
    }[role]
    base = cls(model=str(default_checkpoint("tiny")), security=SecuritySettings(insecure=True))
    base.check()
    accepted = []
    for f in dataclasses.fields(cls):
        if f.type not in ("int", "float", "int | None", "float | None"):
            continue
        bads: tuple[float, ...] = (-1, float("nan")) if "float" in str(f.type) else (-1,)
        if f.name.endswith("_s"):  # 1e10 s overflowed gRPC's deadlines: every call failed
            bads += (1e10, float("inf"))
        if f.name.endswith("_ms"):  # a batch window of 1e300 ms hung every image request
            bads += (1e300,)
        if "int" in str(f.type):  # past a C int: an overflow at start naming no setting
            bads += (10**20,)
        for bad in bads:
            try:
                dataclasses.replace(base, **{f.name: bad}).check()
            except SettingsError as exc:
                assert str(exc).startswith(f.name), exc
            else:
                if (cls.__name__, f.name) not in MEANS_SOMETHING_AT_MINUS_1:
                    accepted.append(f"{f.name}={bad}")
    assert accepted == []
    with pytest.raises(SettingsError, match="max_message_mb"):  # a C int in gRPC's options
        dataclasses.replace(base, max_message_mb=2048).check()
    with pytest.raises(SettingsError, match="grpc_max_connections"):  # so is this (s42diff)
        dataclasses.replace(base, grpc_max_connections=(1 << 31) - 1).check()  # an abort
    dataclasses.replace(base, grpc_max_connections=(1 << 31) - 2).check()
    if role == "prefill":
        with pytest.raises(SettingsError, match="prefill_chunk"):
            dataclasses.replace(base, prefill_chunk=0).check()


def test_router_limits_whose_zero_refuses_everything_are_refused() -> None:
    # Each was taken at start, then refused every request of its kind (s42 operator L5;
    # ownfixA review: the video ones). A fetch limit with fetching off is not used.
    import dataclasses

    from common.models.tiny import default_checkpoint
    from common.settings.schema import SettingsError
    from common.settings.security import SecuritySettings
    from router.settings import RouterSettings

    base = RouterSettings(
        model=str(default_checkpoint("tiny")), security=SecuritySettings(insecure=True)
    )
    for name in (
        "max_prompt_text_bytes",
        "max_image_pixels",
        "max_media_bytes",
        "max_video_file_bytes",
        "max_video_seconds",
        "max_video_decoded_pixels",
    ):
        with pytest.raises(SettingsError, match=f"^{name}: must be positive"):
            zero: dict[str, Any] = {name: 0}
            dataclasses.replace(base, **zero).check()
    dataclasses.replace(base, http_fetch_max_bytes=0).check()
    with pytest.raises(SettingsError, match=r"^http_fetch_max_bytes"):
        dataclasses.replace(base, http_fetch_max_bytes=0, http_fetch_urls=True).check()
