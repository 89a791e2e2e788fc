"""Media URLs of HTTP requests (`router.http.media`): data URLs always, local files only
inside `http_media_dir`, https only when fetching is on and only from public addresses
(with any IPv4 address an IPv6 one embeds public too). A URL that cannot even be parsed is
refused naming its field, as any other (never a 500)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from common.errors import FieldError
from router.http.media import MediaPolicy, is_public, load, public_address


def test_media_urls_are_refused_unless_allowed(tmp_path: Path) -> None:
    for url in ("https://example.com/cat.png", "http://127.0.0.1/x.png", "/etc/passwd"):
        with pytest.raises(FieldError) as err:
            load(url, "f", MediaPolicy())
        assert err.value.field == "f"
    (tmp_path / "cat.png").write_bytes(b"png")
    allowed = MediaPolicy(media_dir=tmp_path)
    assert load(f"file://{tmp_path}/cat.png", "f", allowed) == b"png"
    assert load(f"file://localhost{tmp_path}/cat.png", "f", allowed) == b"png"
    with pytest.raises(FieldError) as err:
        load(f"{tmp_path}/../cat.png", "f", allowed)
    assert str(tmp_path) not in str(err.value)  # where the server keeps media is its own
    with pytest.raises(FieldError, match="another host"):  # was read as the local path
        load(f"file://otherhost{tmp_path}/cat.png", "f", allowed)
    with pytest.raises(FieldError) as err:  # an OSError: a 500 and a traceback naming it
        load(f"file://{tmp_path}/{'a' * 5000}.png", "f", allowed)
    assert str(tmp_path) not in str(err.value)
    with pytest.raises(FieldError, match="non-public"):  # resolved, then refused
        load("https://localhost/cat.png", "f", MediaPolicy(fetch_urls=True))
    # A relative path is inside the folder (it was refused as "expected a data URL":
    # walkthrough review, s39), and never out of it; without a folder, it is no URL.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "dog.png").write_bytes(b"dog")
    assert load("cat.png", "f", allowed) == b"png"
    assert load("sub/dog.png", "f", allowed) == load("sub/../sub/dog.png", "f", allowed)
    for outside in ("../cat.png", "sub/../../cat.png"):
        with pytest.raises(FieldError, match="no such file under http_media_dir"):
            load(outside, "f", allowed)
    assert load("file:sub/dog.png", "f", allowed) == b"dog"  # the folder's, not the cwd's
    for nothing in ("cat.png", ""):
        with pytest.raises(FieldError, match="expected a data URL"):
            load(nothing, "f", MediaPolicy())
    with pytest.raises(FieldError, match="expected a data URL"):
        load("", "f", allowed)


@pytest.mark.parametrize(
    ("url", "policy"),
    [
        ("http://[::1/cat.png", MediaPolicy()),  # an IPv6 host without its "]"
        ("https://[bad/cat.png", MediaPolicy(fetch_urls=True)),
        ("https://example.com:99999/cat.png", MediaPolicy(fetch_urls=True)),  # a bad port
        ("https://example.com:cat/cat.png", MediaPolicy(fetch_urls=True)),
        ("https://" + "a" * 64 + ".example/cat.png", MediaPolicy(fetch_urls=True)),  # idna
        ("/srv/media/cat\x00.png", MediaPolicy(media_dir=Path("/srv/media"))),  # NUL
        ("file:///srv/media/cat%00.png", MediaPolicy(media_dir=Path("/srv/media"))),
    ],
)
def test_a_malformed_url_is_a_field_error_not_a_crash(url: str, policy: MediaPolicy) -> None:
    with pytest.raises(FieldError) as err:
        load(url, "messages[0].content[0].image_url.url", policy)
    assert err.value.field == "messages[0].content[0].image_url.url"


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("::ffff:8.8.8.8", True),
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
        ("10.0.0.1", False),
        ("100.64.0.1", False),  # shared address space (carrier NAT)
        ("169.254.169.254", False),  # cloud metadata
        ("::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),
        ("::127.0.0.1", False),  # IPv4-compatible: Python 3.11 calls it global
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1: likewise
        ("64:ff9b:1::a9fe:a9fe", False),  # local-use NAT64 of 169.254.169.254
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
        ("fe80::1%eth0", False),
    ],
)
def test_a_fetched_host_must_be_public_with_any_ipv4_address_it_embeds(
    address: str, public: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert is_public(address) is public
    info = (socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM, 6, "")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(*info, (address, 443))])
    if public:
        assert public_address("cats.example", 443, "f") == address
    else:
        with pytest.raises(FieldError, match="non-public"):
            public_address("cats.example", 443, "f")


def test_base64_in_short_lines_costs_about_its_size() -> None:
    # Lines of 2 characters: stripping them made an object per piece, 20x the payload (one
    # 256 MiB body held ~5 GB, the event loop stalled meanwhile).
    import base64
    import tracemalloc

    data = bytes(range(256)) * 12_000
    encoded = base64.b64encode(data).decode()
    wrapped = "\n".join(encoded[i : i + 2] for i in range(0, len(encoded), 2))
    url = "data:image/png;base64," + wrapped
    tracemalloc.start()
    try:
        assert load(url, "url", MediaPolicy()) == data
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(url), (peak, len(url))  # the payload, its bytes, them stripped
    with pytest.raises(FieldError, match="base64"):
        load("data:image/png;base64,QU\n\u00e9", "url", MediaPolicy())


def test_data_urls_unpadded_or_url_safe_are_read_and_an_empty_one_is_refused() -> None:
    # Encoders that write base64url, or drop the padding, were refused; an empty data URL
    # of a video was blamed on `video.frames`, a field the HTTP API does not have.
    import base64

    data = bytes([251, 255, 191, 0])  # "+/" in standard base64, "-_" in base64url
    for encoded in (
        base64.b64encode(data),
        base64.urlsafe_b64encode(data),
        base64.urlsafe_b64encode(data).rstrip(b"="),
    ):
        assert load("data:image/png;base64," + encoded.decode(), "url", MediaPolicy()) == data
    for bad in ("QQ=Q", "Q", "Q!=="):
        with pytest.raises(FieldError, match="not valid base64"):
            load("data:image/png;base64," + bad, "url", MediaPolicy())
    with pytest.raises(FieldError, match="names an empty file") as err:
        load("data:video/mp4;base64,", "messages[0].content[0].video_url.url", MediaPolicy())
    assert err.value.field == "messages[0].content[0].video_url.url"


def trickling_host(
    tmp_path: Path, stage: str, done: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> str:
    """The URL of a TLS host (trusted for "localhost" through SSL_CERT_FILE, and taken as
    public) that sends its answer's head ("head") or body ("body") a byte every 0.2 s until
    `done`."""
    import ssl

    from router.http import media
    from tests.test_tls import make_certificates

    make_certificates(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server = socket.create_server(("127.0.0.1", 0))
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n"

    def trickle() -> None:
        with server:
            conn, _ = server.accept()
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1 << 16)
                if stage == "body":
                    tls.sendall(head)
                for byte in head if stage == "head" else b"x" * 30:
                    if done.wait(0.2):
                        return
                    with contextlib.suppress(OSError):
                        tls.sendall(bytes([byte]))

    threading.Thread(target=trickle, daemon=True).start()
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    monkeypatch.setattr(media, "public_address", lambda host, port, field: "127.0.0.1")
    return f"https://localhost:{server.getsockname()[1]}/cat.png"


@pytest.mark.parametrize("stage", ["head", "body"])
def test_a_fetch_that_trickles_is_cut_at_fetch_timeout_s(
    stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The timeout bounded each read, and the deadline was checked between reads of 64 KiB:
    # a server sending a byte a second held one of the router's threads as long as it liked.
    done = threading.Event()
    url = trickling_host(tmp_path, stage, done, monkeypatch)
    started = time.monotonic()
    try:
        with pytest.raises(FieldError, match="took over 1"):
            load(url, "f", MediaPolicy(fetch_urls=True, fetch_timeout_s=1.0))
    finally:
        done.set()
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("stage", ["head", "body"])
def test_a_fetch_from_a_stalled_host_ends_once_the_client_is_gone(
    stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client's leaving was checked between chunks only: a host that stalled held the
    # tenant's thread to http_fetch_timeout_s for a client that had left (review of the fix).
    from router.http.errors import ApiError

    done = threading.Event()
    url = trickling_host(tmp_path, stage, done, monkeypatch)
    started = time.monotonic()
    left = threading.Event()
    leaves = threading.Timer(0.5, left.set)  # the client leaves at 0.5 s; the host stalls on
    leaves.start()
    try:
        with pytest.raises(ApiError, match="the client went away") as err:
            load(url, "f", MediaPolicy(fetch_urls=True, fetch_timeout_s=30.0), gone=left.is_set)
    finally:
        leaves.cancel()
        done.set()
    assert err.value.grpc_code == grpc.StatusCode.CANCELLED
    assert time.monotonic() - started < 2.0


def test_a_connect_the_host_never_answers_ends_once_the_client_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The connection was twinned for `abort` only once connected: a connect to a host that
    # drops its SYNs held the thread to http_fetch_timeout_s for a client long gone.
    from router.http import media
    from router.http.errors import ApiError

    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(0)  # its accept queue filled below: the kernel drops further SYNs
    port = host.getsockname()[1]
    fillers = [socket.socket() for _ in range(3)]
    for filler in fillers:
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
    monkeypatch.setattr(media, "public_address", lambda host, port, field: "127.0.0.1")
    url = f"https://localhost:{port}/cat.png"
    left = threading.Event()
    leaves = threading.Timer(0.5, left.set)
    try:
        time.sleep(0.2)
        started = time.monotonic()
        leaves.start()
        with pytest.raises(ApiError, match="the client went away"):
            load(url, "f", MediaPolicy(fetch_urls=True, fetch_timeout_s=30.0), gone=left.is_set)
        assert time.monotonic() - started < 2.0
        # Its time running out while it connects still says so (not "fetching failed").
        with pytest.raises(FieldError, match=r"took over 0\.5 s"):
            load(url, "f", MediaPolicy(fetch_urls=True, fetch_timeout_s=0.5))
    finally:
        leaves.cancel()
        for sock in (*fillers, host):
            sock.close()


def test_a_requests_media_are_held_as_read_and_bounded_in_all(tmp_path: Path) -> None:
    # A 2 KB body naming one 50 MB file twenty times took a router from 0.3 to 1.4 GB with
    # `requests_in_flight_mb` at 64: nothing read from a URL was counted.
    from router.http.convert import chat_request
    from router.http.schema import ChatCompletionRequest

    (tmp_path / "big.png").write_bytes(b"x" * (3 << 20))
    part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/big.png"}}
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [part] * 5}]}
    )
    policy = MediaPolicy(media_dir=tmp_path, max_request_bytes=8 << 20)
    held: list[int] = []
    with pytest.raises(FieldError) as err:
        chat_request(body, "r", policy, held.append)
    assert err.value.field == "messages[0].content[2].image_url.url"  # 9 MiB > 8
    assert "max_message_mb" in str(err.value) and held == [3 << 20] * 2

    class Busy(Exception):
        pass

    def refuse_the_second(size: int) -> None:
        if held:
            raise Busy  # the 429 of `requests_in_flight_mb`
        held.append(size)

    held.clear()
    with pytest.raises(Busy):
        chat_request(body, "r", MediaPolicy(media_dir=tmp_path), refuse_the_second)
    assert held == [3 << 20]


def test_no_medium_is_read_past_the_requests_deadline(tmp_path: Path) -> None:
    # Fetches of http_fetch_timeout_s each held a thread for as many URLs as a body named,
    # past the request's own time and after its client left.
    import time

    from router.http.convert import chat_request
    from router.http.errors import ApiError
    from router.http.schema import ChatCompletionRequest

    (tmp_path / "cat.png").write_bytes(b"png")
    part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/cat.png"}}
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [part] * 3}]}
    )
    held: list[int] = []
    with pytest.raises(ApiError) as err:
        chat_request(body, "r", MediaPolicy(media_dir=tmp_path), held.append, time.monotonic())
    assert err.value.status == 504 and held == []
    assert "messages[0].content[0].image_url.url" in str(err.value)


def test_a_symlink_loop_or_a_fifo_is_a_field_error(tmp_path: Path) -> None:
    # A loop was a 500 with a traceback (Python 3.11's resolve raises RuntimeError), also for
    # a path outside the folder, which was looked up before it was refused (s39diff F3).
    media = tmp_path / "media"
    media.mkdir()
    (media / "loop").symlink_to("loop")
    (tmp_path / "outer").symlink_to("outer")
    os.mkfifo(media / "pipe")  # opened without blocking, and refused: no regular file
    policy = MediaPolicy(media_dir=media)
    for url in ("loop", "file:loop", f"{media}/loop", "loop/x.png", "pipe", f"{tmp_path}/outer"):
        with pytest.raises(FieldError) as err:
            load(url, "messages[0].content[0].image_url.url", policy)
        assert err.value.field == "messages[0].content[0].image_url.url"
    with pytest.raises(FieldError, match="no such file"):  # refused as written, not looked up
        load(f"{tmp_path}/outer", "f", policy)


def test_a_path_is_read_as_written_and_a_file_url_decoded(tmp_path: Path) -> None:
    # A bare path was %-decoded and cut at "?" and "#": "50%25.png" read "50%.png", and
    # "what?.png" could not be named; "img:1.png" was read as a URL scheme (s39diff F4).
    for name, data in (("50%25.png", b"literal"), ("50%.png", b"decoded"), ("what?.png", b"q")):
        (tmp_path / name).write_bytes(data)
    (tmp_path / "h#x.png").write_bytes(b"h")
    (tmp_path / "img:1.png").write_bytes(b"colon")
    policy = MediaPolicy(media_dir=tmp_path)
    assert load("50%25.png", "f", policy) == b"literal"
    assert load(f"{tmp_path}/50%25.png", "f", policy) == b"literal"
    assert load("file:50%25.png", "f", policy) == b"decoded"  # a URL: %25 is "%"
    assert load("what?.png", "f", policy) == b"q" and load("h#x.png", "f", policy) == b"h"
    assert load("img:1.png", "f", policy) == b"colon"
    with pytest.raises(FieldError, match="expected a data URL"):  # a URL of another scheme
        load("ftp://example.com/cat.png", "f", policy)


def test_a_folder_named_leaks_no_descriptor_and_a_linked_folder_reads_as_set(
    tmp_path: Path,
) -> None:
    # Each request naming a folder left its descriptor open (os.open succeeds on a folder):
    # a router's descriptors ran out. A folder set through a link (/srv -> /mnt/disk) was
    # refused by its absolute paths (ownfixA review M1, M2).
    (tmp_path / "disk" / "media" / "sub").mkdir(parents=True)
    (tmp_path / "disk" / "media" / "cat.png").write_bytes(b"cat")
    (tmp_path / "srv").symlink_to(tmp_path / "disk")
    set_as = tmp_path / "srv" / "media"
    policy = MediaPolicy(media_dir=set_as)
    before = len(os.listdir("/proc/self/fd"))
    for url in (".", "sub", "sub/", "file:sub", str(set_as)):
        with pytest.raises(FieldError, match="no such file"):
            load(url, "f", policy)
    assert len(os.listdir("/proc/self/fd")) == before
    assert load(f"{set_as}/cat.png", "f", policy) == b"cat"
    assert load(f"file://{set_as}/cat.png", "f", policy) == b"cat"
    assert load(f"{tmp_path}/disk/media/cat.png", "f", policy) == b"cat"  # as resolved, too
