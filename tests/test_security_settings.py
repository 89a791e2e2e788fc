"""The `[security]` table: the cluster token file, the API keys file, `--insecure`, `epd serve`
making a token and keys per deployment, the method -> principal policy and the tenant salts."""

from __future__ import annotations

import hashlib
import hmac
import logging
import stat
from pathlib import Path

import pytest

from cluster.serve import with_api_keys, with_cluster_token
from cluster.settings import ROLES, EpdSettings
from common.server.auth import Authenticator, Caller, Need, need_for
from common.settings.api_keys import default_api_key, load_api_keys
from common.settings.schema import SettingsError, from_mapping
from common.settings.security import SecuritySettings, write_token_file
from decode_worker.settings import DecodeSettings
from encoder_worker.requests import salted_key
from prefill_worker.__main__ import parse
from router.tenants import tenant_salt
from tests.cluster import ADMIN_KEY, CLIENT_KEY, cluster_security


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


def test_epd_serve_keeps_each_roles_own_tls_and_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The deployment's token (and keys) fill in what a role's own table leaves unset; they
    # used to replace the whole table, so its TLS files were dropped without a word.
    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    tls = {"tls_cert_file": "/tls/cert.pem", "tls_key_file": "/tls/key.pem"}
    keys = {"api_keys_file": "/run/keys.toml"}
    given = from_mapping(
        EpdSettings, {"router": {"security": {**tls, **keys}}, "prefill": {"security": tls}}
    )
    full = with_api_keys(with_cluster_token(given)).with_model()
    token = str(tmp_path / "epd" / "cluster_token")
    for role in ("router", "prefill"):
        security = getattr(full, role).security
        assert (security.tls_cert_file, security.tls_key_file) == ("/tls/cert.pem", "/tls/key.pem")
        assert security.cluster_token_file == token
    assert full.router.security.api_keys_file == "/run/keys.toml"
    assert full.decode.security.tls_cert_file is None
    assert full.decode.security.cluster_token_file == token


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


def test_a_token_given_to_one_role_is_every_roles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given in [router.security] only, the other roles got a fresh token of their own: the
    # check passed, then no worker could register, and `epd serve` waited its 600 s.
    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    given = from_mapping(EpdSettings, {"router": {"security": {"cluster_token_file": "/t"}}})
    full = with_cluster_token(given).with_model()
    assert {r.security.cluster_token_file for r in full.role_settings().values()} == {"/t"}
    assert not (tmp_path / "epd" / "cluster_token").exists()
    # Two files for two roles and none for the others: which would the others take?
    split = from_mapping(
        EpdSettings,
        {
            "router": {"security": {"cluster_token_file": "/t"}},
            "prefill": {"security": {"cluster_token_file": "/u"}},
        },
    )
    with pytest.raises(SettingsError, match="different files"):
        with_cluster_token(split)
    # Every role a file: the tokens they hold must be one, whatever the paths.
    one, other = "t" * 40, "t" * 40 + "\u00a0"  # a no-break space is no whitespace to strip
    for name, token in (("a", one), ("b", one), ("c", other)):
        (tmp_path / name).write_text(token + "\n")
    every = {role: {"security": {"cluster_token_file": str(tmp_path / "a")}} for role in ROLES}
    every["router"] = {"security": {"cluster_token_file": str(tmp_path / "b")}}  # same token
    same = from_mapping(EpdSettings, every)
    assert with_cluster_token(same) is same
    every["decode"] = {"security": {"cluster_token_file": str(tmp_path / "c")}}  # another
    with pytest.raises(SettingsError, match="hold different tokens"):
        with_cluster_token(from_mapping(EpdSettings, every))
    # Two files of one token, and roles naming none: they take the first.
    two = {
        "router": {"security": {"cluster_token_file": str(tmp_path / "a")}},
        "prefill": {"security": {"cluster_token_file": str(tmp_path / "b")}},
    }
    shared = with_cluster_token(from_mapping(EpdSettings, two))
    assert shared.security.cluster_token_file == str(tmp_path / "a")


def test_a_refused_epd_serve_leaves_the_running_deployments_secrets_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second `epd serve` refused because a deployment already runs in its namespace used to
    # write a new token and keys first: that deployment's clients got UNAUTHENTICATED, and
    # its workers could not register again after a restart.
    import cluster.ray_start
    from cluster import serve
    from common.settings.schema import SettingsError

    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    monkeypatch.setattr(serve, "_prepare_checkpoint", lambda settings: None)
    monkeypatch.setattr(serve, "check_ports", lambda settings: None)
    monkeypatch.setattr(cluster.ray_start, "init_ray", lambda ray, log_level: False)

    def running(namespace: str) -> None:
        raise SettingsError(f"ray.namespace: a deployment already runs in {namespace!r}")

    monkeypatch.setattr(cluster.ray_start, "refuse_if_running", running)
    with pytest.raises(SettingsError, match="already runs"):
        serve.cmd_serve(EpdSettings())
    assert [p.name for p in (tmp_path / "epd").iterdir()] == [serve.LOCK_FILE]


def test_a_second_epd_serve_of_a_namespace_on_this_machine_is_refused_before_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each local `epd serve` starts its own Ray cluster, where `refuse_if_running` sees no
    # other deployment: the second one wrote its token and keys over the first one's, whose
    # clients were then refused, and whose restarted workers read the new token and were
    # refused by their own router (new-user review).
    import cluster.ray_start
    from cluster import serve
    from common.settings.schema import SettingsError

    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    monkeypatch.setattr(serve, "check_ports", lambda settings: None)

    def no_ray(ray: object, log_level: str) -> bool:
        raise AssertionError("Ray started")

    monkeypatch.setattr(cluster.ray_start, "init_ray", no_ray)
    first = with_api_keys(with_cluster_token(EpdSettings()))  # the running one's secrets
    secrets = {p.name: p.read_bytes() for p in (tmp_path / "epd").iterdir()}
    with serve.holding_namespace("epd"):
        with pytest.raises(SettingsError, match=r"ray.namespace: an epd serve .* \(pid \d+"):
            serve.cmd_serve(EpdSettings())
        with serve.holding_namespace("other"):  # another namespace is another folder
            pass
    after = {p.name: p.read_bytes() for p in (tmp_path / "epd").iterdir() if p.name in secrets}
    assert after == secrets and first.security.cluster_token_file is not None
    with serve.holding_namespace("epd"):  # released with its holder
        pass


def test_the_namespace_lock_is_skipped_with_a_warning_where_it_cannot_be_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A read-only $EPD_HOME, or a filesystem without locks, failed `epd serve --insecure`
    # (which writes nothing there) with a bare errno (own-fix review).
    import errno
    import fcntl

    from cluster import serve

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("EPD_HOME", str(tmp_path / "file"))  # not a folder
    with serve.holding_namespace("epd"):
        pass
    assert "warning: cannot hold" in capsys.readouterr().out
    monkeypatch.setenv("EPD_HOME", str(tmp_path))

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with serve.holding_namespace("epd"):
        pass
    assert "warning: cannot lock" in capsys.readouterr().out


@pytest.mark.parametrize("namespace", ["", ".", "..", "../../x", "a/b", "a\\b"])
def test_a_namespace_is_a_plain_name(namespace: str) -> None:
    # It names the folder $EPD_HOME/<namespace>: "../../x" put the lock (and keys) outside.
    from cluster.settings import RaySettings
    from common.settings.schema import SettingsError

    with pytest.raises(SettingsError, match=r"ray\.namespace: .* must be a plain name"):
        EpdSettings(ray=RaySettings(namespace=namespace)).check()


def test_tenant_salts() -> None:
    key = b"k" * 32
    a, b = tenant_salt(key, "a", None), tenant_salt(key, "b", None)
    assert a is not None and b is not None and a != b
    assert tenant_salt(key, "a", None) == a  # stable
    assert tenant_salt(key, "a", "") not in (a, tenant_salt(key, "b", ""))
    assert tenant_salt(b"x" * 32, "a", None) != a  # another deployment, other salts
    assert tenant_salt(None, None, "mine") == "mine"  # insecure: no tenants
    # A tenant's cache epoch: a new one is a new cache, the same name notwithstanding, and
    # no epoch keeps the salts of before (caches of running deployments stay theirs).
    assert (
        a
        == "tenant:"
        + hmac.new(key, b"\0\0\0\x12epd-tenant-salt-v1\0\0\0\x01a", hashlib.sha256).hexdigest()
    )
    again = tenant_salt(key, "a", None, "2026-12")
    assert again not in (a, tenant_salt(key, "a", "2026-12"), tenant_salt(key, "a", None, "x"))
    assert tenant_salt(key, "a", "s", "e") != tenant_salt(key, "a", "e", "s")


def test_a_tenants_keys_share_one_cache_epoch(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    entry = '[[keys]]\nkey = "{key}"\ntenant = "{tenant}"\n{extra}\n'
    path.write_text(
        entry.format(key="k" * 16, tenant="acme", extra='cache_epoch = "2"')
        + entry.format(key="l" * 16, tenant="acme", extra='cache_epoch = "2"')
        + entry.format(key="m" * 16, tenant="ops", extra="")
    )
    keys = load_api_keys(path)
    assert [k.cache_epoch for k in keys] == ["2", "2", ""]
    caller = Authenticator(None, keys).identify([("authorization", "Bearer " + "l" * 16)])
    assert caller == Caller("acme", cache_epoch="2")  # the router salts with it
    path.write_text(
        entry.format(key="k" * 16, tenant="acme", extra='cache_epoch = "2"')
        + entry.format(key="l" * 16, tenant="acme", extra="")
    )
    with pytest.raises(SettingsError, match=r"keys\[1\]\.cache_epoch: differs"):
        load_api_keys(path)
    path.write_text(entry.format(key="k" * 16, tenant="acme", extra="cache_epoch = 2"))
    with pytest.raises(SettingsError, match=r"keys\[0\]\.cache_epoch"):
        load_api_keys(path)


def test_every_method_maps_to_its_principal() -> None:
    assert need_for("/grpc.health.v1.Health/Check") is Need.OPEN
    assert need_for("/epd.v1.RouterService/Generate") is Need.CLIENT
    for method in ("Status", "Scale", "Drain"):
        assert need_for(f"/epd.v1.AdminService/{method}") is Need.ADMIN
    for method in (
        "/epd.v1.RegistryService/Register",
        "/epd.v1.EncoderService/Encode",
        "/epd.v1.PrefillService/Prefill",
        "/epd.v1.PrefillService/ReleaseKv",
        "/epd.v1.DecodeService/Decode",
        "/epd.v1.SomethingNew/Method",
    ):
        assert need_for(method) is Need.CLUSTER, method
    keys = load_api_keys(str(cluster_security().api_keys_file))
    auth = Authenticator(cluster_security().cluster_bearer(), keys)
    assert auth.identify([("authorization", f"Bearer {CLIENT_KEY}")]) == Caller("tenant-a")
    assert auth.identify([("authorization", f"Bearer {ADMIN_KEY}")]) == Caller("ops", admin=True)
    assert auth.identify([("authorization", CLIENT_KEY)]) is None  # no scheme
    assert auth.identify([]) is None


def test_epd_serve_writes_the_deployments_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    monkeypatch.delenv("EPD_API_KEY", raising=False)
    settings = with_api_keys(with_cluster_token(EpdSettings()))
    path = Path(str(settings.security.api_keys_file))
    assert path == tmp_path / "epd" / "api_keys.toml"
    for name in ("api_keys.toml", "client_key", "admin_key"):
        assert stat.S_IMODE((tmp_path / "epd" / name).stat().st_mode) == 0o600
    keys = load_api_keys(path)
    auth = Authenticator(None, keys)
    client, admin = default_api_key("client_key"), default_api_key("admin_key")
    assert client and admin and client != admin
    assert auth.identify([("authorization", f"Bearer {client}")]) == Caller("default")
    assert auth.identify([("authorization", f"Bearer {admin}")]) == Caller("admin", admin=True)
    assert settings.with_model().router.security.api_keys_file == str(path)
    monkeypatch.setenv("EPD_API_KEY", "from-the-env")
    assert default_api_key("admin_key") == "from-the-env"
    insecure = EpdSettings(security=SecuritySettings(insecure=True))
    assert with_api_keys(insecure) is insecure


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not toml [", "not TOML"),
        ("", "has no "),
        ('[[keys]]\nkey = "short"\ntenant = "t"\n', r"keys\[0\]\.key"),
        ('[[keys]]\nkey = "a-long-enough-key-1"\ntenant = ""\n', r"keys\[0\]\.tenant"),
        ('[[keys]]\nkey = "a-long-enough-key-1"\ntenant = "t"\nadmin = 1\n', "admin"),
        ('[[keys]]\nkey = "a-long-enough-key-1"\ntenant = "t"\nadmn = true\n', r"\.admn: unknown"),
        ('[[keys]]\nkey = "a-long-enough-key-1"\ntenant = "t"\n' * 2, "twice"),
        # A client's bearer secret is stripped: a stored key with spaces never matched.
        ('[[keys]]\nkey = " a-long-enough-key-1"\ntenant = "t"\n', r"keys\[0\]\.key.*spaces"),
        ('[[keys]]\nkey = "a-long-enough\\tkey-1"\ntenant = "t"\n', r"keys\[0\]\.key.*spaces"),
    ],
)
def test_bad_api_keys_files_name_the_entry(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message) as info:
        load_api_keys(path)
    assert "security.api_keys_file" in str(info.value)


def test_secret_files_open_to_others_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys, token = tmp_path / "keys.toml", tmp_path / "token"
    keys.write_text('[[keys]]\nkey = "a-long-enough-key-1"\ntenant = "t"\n')
    token.write_text("x" * 40)
    settings = SecuritySettings(cluster_token_file=str(token))
    for mode in (0o600, 0o400, 0o440):  # 0440: a Kubernetes secret volume with an fsGroup
        keys.chmod(mode)
        token.chmod(mode)
        with caplog.at_level(logging.WARNING):
            load_api_keys(keys), settings.cluster_key()
        assert "open to other users" not in caplog.text
    keys.chmod(0o644)
    token.chmod(0o604)
    with caplog.at_level(logging.WARNING):
        load_api_keys(keys), settings.cluster_key()
    assert "security.api_keys_file" in caplog.text and "mode 644" in caplog.text
    assert "security.cluster_token_file" in caplog.text and "mode 604" in caplog.text


def test_tls_files_go_together() -> None:
    with pytest.raises(SettingsError, match="tls_key_file"):
        SecuritySettings(insecure=True, tls_cert_file="c.pem").check()
    with pytest.raises(SettingsError, match="tls_ca_file"):
        SecuritySettings(insecure=True, tls_ca_file="ca.pem").check()


def test_the_encoder_cache_key_is_tenant_separated() -> None:
    key = bytes(range(32))
    a, b = salted_key(key, "tenant:a"), salted_key(key, "tenant:b")
    assert len(a) == 32 and len({key, a, b}) == 3
    assert salted_key(key, "tenant:a") == a


def test_two_authorization_entries_identify_no_one(tmp_path: Path) -> None:
    # The first was read: a proxy that checked the other one (or added its own) disagreed
    # with the server about who called. The HTTP API refuses two headers the same way.
    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\nkey = "{}"\ntenant = "acme"\n'.format("k" * 16))
    auth = Authenticator(None, load_api_keys(path))
    good, bad = ("authorization", "Bearer " + "k" * 16), ("authorization", "Bearer nobody-at-all")
    assert auth.identify([good]) == Caller("acme")
    assert auth.identify([good, bad]) is None and auth.identify([bad, good]) is None
