"""epd.client's wire form: messages and media to a `GenerateRequest`, no network.

What the client sends must decode on the router to the same pixels and sampling the caller
gave (the router's side is `router.inputs`)."""

from __future__ import annotations

import base64
import io
import re

import grpc
import numpy as np
import pytest
from PIL import Image

from common.processing.messages import ImagePart, Message, TextPart, VideoPart
from common.sampling import SamplingParams
from common.wire.sampling import sampling_from_proto
from epd.client import Client, build_request, encode_image
from router.inputs import decode_image, messages_from_proto


def pixels(seed: int, h: int = 12, w: int = 20) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["pil", "array", "bytes", "path"])
def test_image_sources_arrive_with_identical_pixels(kind, tmp_path):
    array = pixels(1)
    path = tmp_path / "x.png"
    path.write_bytes(png_bytes(array))
    source = {
        "pil": Image.fromarray(array),
        "array": array,
        "bytes": png_bytes(array),
        "path": str(path),
    }[kind]
    data = encode_image(source)
    assert np.array_equal(np.asarray(decode_image(data, "x")), array)


def test_chat_round_trips_through_the_router_edge():
    video = np.stack([pixels(k) for k in range(3)])
    url = "data:image/png;base64," + base64.b64encode(png_bytes(pixels(9))).decode()
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "video", "video": video, "fps": 4.0, "uuid": "v1"},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        },
    ]
    sampling = SamplingParams(temperature=0.5, top_k=5, seed=7, max_tokens=9, stop_token_ids=(3,))
    request = build_request(messages, sampling, request_id="r", cache_salt="tenant")
    assert request.request_id == "r" and request.cache_salt == "tenant"
    assert sampling_from_proto(request.sampling) == sampling
    decoded = messages_from_proto(request.messages)
    assert decoded[0] == Message("system", (TextPart("Be brief."),))
    assert decoded[1].role == "user"
    clip, text, image = decoded[1].content
    assert isinstance(clip, VideoPart) and clip.fps == 4.0 and clip.uuid == "v1"
    assert clip.frames is not None and clip.index is None
    assert np.array_equal(np.stack([np.asarray(f) for f in clip.frames]), video)
    assert text == TextPart("and")
    assert isinstance(image, ImagePart) and image.uuid is None
    assert np.array_equal(np.asarray(image.data), pixels(9))


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "video", "video": [pixels(1)]}, "needs a positive fps"),
        ({"type": "video", "video": [], "fps": 2.0}, "no frames"),
        ({"type": "image", "image": 3.5}, "unsupported image source"),
        ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "data URLs"),
        ({"type": "audio"}, "unsupported content part type"),
        # Each raised something else, naming no part.
        ({"type": "image", "image": "/nonexistent.png"}, "cannot read /nonexistent.png"),
        ({"type": "video", "video": [pixels(1)], "fps": "fast"}, "fps: not a number"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,a$b"}}, "base64"),
        # An image given as a video was sent as H grey frames of W x 3 pixels.
        ({"type": "video", "video": np.zeros((4, 4, 3), np.uint8), "fps": 2}, r"\(T, H, W, C\)"),
    ],
)
def test_unsendable_parts_name_the_part(part, message):
    with pytest.raises(ValueError, match=message) as err:
        build_request([{"role": "user", "content": [part]}])
    assert "messages[0].content[0]" in str(err.value)


def test_default_sampling_is_the_library_default():
    request = build_request([{"role": "user", "content": "hi"}])
    assert sampling_from_proto(request.sampling) == SamplingParams()


def test_stop_strings_travel_in_the_request():
    request = build_request([{"role": "user", "content": "hi"}], stop=["\n\n", "END"])
    assert list(request.stop) == ["\n\n", "END"]
    assert list(build_request([{"role": "user", "content": "hi"}]).stop) == []
    # One string is one stop string, as OpenAI's (it was one per character: the answer was
    # cut at its first "e" for stop="<end>").
    assert list(build_request([{"role": "user", "content": "hi"}], stop="<end>").stop) == ["<end>"]
    assert list(build_request([{"role": "user", "content": "hi"}], stop="").stop) == []


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ({"role": "user", "content": "hi"}, "messages: expected a list"),
        (["hello"], r"messages\[0\]: expected a message"),
        ([{"role": "user", "content": {"type": "text", "text": "hi"}}], r"\[0\].content: expected"),
        ([{"role": "user", "content": ["hi"]}], r"content\[0\]: expected a part"),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], r"\[0\].text: expected"),
    ],
)
def test_messages_of_the_wrong_shape_are_refused_naming_where(messages, message):
    # They raised AttributeError naming nothing, or sent None as the text "None".
    with pytest.raises(ValueError, match=message):
        build_request(messages)


async def test_an_api_key_is_stripped_and_one_no_header_can_carry_is_refused() -> None:
    import pickle

    from epd.answers import GenerateError
    from epd.client import Client

    client = Client("127.0.0.1:1", api_key="key\n")  # read from a file with its newline
    try:
        with pytest.raises(ValueError, match="api_key"):
            async for _ in client.generate([{"role": "user", "content": "hi"}], api_key="k\u00e9"):
                pass
    finally:
        await client.close()
    with pytest.raises(ValueError, match="api_key"):
        Client("127.0.0.1:1", api_key="k\te y")
    # A process pool's worker raising it: unpickling it broke the pool.
    error = pickle.loads(pickle.dumps(GenerateError(grpc.StatusCode.UNAVAILABLE, "gone")))
    assert (error.code, error.details, str(error)) == (
        grpc.StatusCode.UNAVAILABLE,
        "gone",
        "UNAVAILABLE: gone",
    )


async def test_router_addresses_come_as_a_list_or_comma_separated() -> None:
    from epd.client import Client, router_list

    assert router_list("a:1") == ["a:1"]
    assert router_list(" a:1, b:2,,a:1 ") == ["a:1", "b:2"]
    assert router_list(["b:2", "a:1"]) == ["b:2", "a:1"]
    with pytest.raises(ValueError, match="router address: none given"):
        router_list(" , ")
    # gRPC dialed an empty port as 443 and one past 65535 modulo 65536: another server.
    for bad in ("h:99999", "h:", "h:0", "h", "[::1]"):
        with pytest.raises(ValueError, match=f"router address '{re.escape(bad)}'"):
            router_list(bad)
    assert router_list("[::1]:50051,dns:///router.local:50051") == [
        "[::1]:50051",
        "dns:///router.local:50051",
    ]
    client = Client("a:1,b:2,c:3", api_key="k")
    assert client.address == "a:1" and client.addresses == ["a:1", "b:2", "c:3"]
    # Each request starts on the next router in turn, then tries the others in order.
    assert [client._turns.order() for _ in range(4)] == [
        [0, 1, 2],
        [1, 2, 0],
        [2, 0, 1],
        [0, 1, 2],
    ]
    await client.close()


def test_a_developer_message_is_sent_as_the_system_role() -> None:
    # OpenAI's newer name of the system role: the HTTP API reads it so, and the router's
    # wire takes system, user and assistant only.
    from epd.request import build_request

    request = build_request([{"role": "developer", "content": "Be brief."}])
    assert request.messages[0].role == "system"


def test_a_client_made_outside_a_loop_works_inside_one() -> None:
    # Its channels were opened in __init__, bound to no running loop: under asyncio.run it
    # failed with a raw RuntimeError ("attached to a different loop"); opened at first use
    # and kept, a second asyncio.run found them on the first one's closed loop.
    import asyncio

    from epd.answers import GenerateError
    from epd.client import Client

    client = Client("127.0.0.1:1", api_key="k")  # a module-level client, as users write

    async def main() -> GenerateError:
        with pytest.raises(GenerateError) as err:
            await client.generate_text([{"role": "user", "content": "hi"}], timeout_s=2)
        return err.value

    for _ in range(2):  # not closed in between
        assert asyncio.run(main()).code == grpc.StatusCode.UNAVAILABLE  # nothing listens
    asyncio.run(client.close())


def test_a_file_past_the_message_limit_is_refused_before_it_is_read(tmp_path):
    # A 600 MB file given by mistake was read whole and copied (1.8 GB for 13 s) before
    # gRPC refused the message, naming no part (client review).
    big = tmp_path / "big.mp4"
    with big.open("wb") as out:  # sparse: 3 MiB that take no disk
        out.truncate(3 << 20)
    chat = [{"role": "user", "content": [{"type": "video", "video": str(big)}]}]
    with pytest.raises(ValueError, match=r"content\[0\]\.video: .*3\.0 MiB, more than"):
        build_request(chat, max_bytes=2 << 20)
    image = [{"role": "user", "content": [{"type": "image", "image": big}]}]
    with pytest.raises(ValueError, match=r"content\[0\]\.image: .*3\.0 MiB"):
        build_request(image, max_bytes=2 << 20)
    # Parts under the limit whose sum is past it: the first part past what is left, unread;
    # a frames folder by the sum of its files.
    half = tmp_path / "half.png"
    half.write_bytes(b"x" * (3 << 19))
    two = [{"role": "user", "content": [{"type": "image", "image": half}] * 2}]
    with pytest.raises(ValueError, match=r"content\[1\]\.image: .*1\.5 MiB, more than the 0\.5"):
        build_request(two, max_bytes=2 << 20)
    frames = tmp_path / "frames"
    frames.mkdir()
    for k in range(3):
        (frames / f"{k}.png").write_bytes(b"x" * (3 << 19))
    video = [{"role": "user", "content": [{"type": "video", "video": str(frames), "fps": 1}]}]
    with pytest.raises(ValueError, match=r"\.video: 3 frame files take 4\.5 MiB"):
        build_request(video, max_bytes=2 << 20)
    # A message of plain text counts too (own-fix review 5: it was skipped).
    text_first = [{"role": "user", "content": "x" * (1 << 20)}, image[0]]
    text_first[1] = {"role": "user", "content": [{"type": "image", "image": half}]}
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[0\]\.image: .*1\.5 MiB"):
        build_request(text_first, max_bytes=2 << 20)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # Each raised TypeError, OSError or a ValueError naming nothing (client review).
        (
            {"part": {"type": "image", "image": np.zeros((2, 2, 5), np.uint8)}},
            r"\[0\]\.image: cannot",
        ),
        (
            {"part": {"type": "image", "image": np.zeros((0, 4, 3), np.uint8)}},
            r"\[0\]\.image: cannot",
        ),
        ({"part": {"type": "image", "image": Image.new("F", (2, 2))}}, r"\[0\]\.image: cannot"),
        ({"part": {"type": "video", "video": 5, "fps": 2}}, r"\[0\]\.video: expected a file"),
        ({"part": {"type": "video", "video": {"a": 1}, "fps": 2}}, r"\.video: expected a file"),
        ({"part": {"type": "text", "text": "a\ud800"}}, r"\[0\]\.text: not UTF-8"),
        ({"messages": None}, "messages: expected a list"),
        ({"stop": 5}, "stop: expected a string or a list"),
        ({"cache_salt": 5}, "cache_salt: expected a string"),
    ],
)
def test_wrong_inputs_are_value_errors_naming_where(kwargs, message):
    part = kwargs.pop("part", {"type": "text", "text": "hi"})
    messages = kwargs.pop("messages", [{"role": "user", "content": [part]}])
    with pytest.raises(ValueError, match=message):
        build_request(messages, **kwargs)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"max_tokens": 2**33}, "max_tokens"),
        ({"top_k": 2**40}, "top_k"),
        ({"stop_token_ids": (2**40,)}, "stop_token_ids"),
    ],
)
def test_sampling_past_the_wires_integers_names_the_field(sampling, field):
    # protobuf said "Value out of range: 8589934592", naming no field.
    with pytest.raises(ValueError, match=field):
        SamplingParams(**sampling)


def test_a_key_file_no_header_can_carry_or_a_ca_file_unread_is_named(tmp_path, monkeypatch):
    # Every call failed INTERNAL "Invalid metadata" (a key file with a non-ASCII byte), or
    # Client() raised UnicodeDecodeError / FileNotFoundError naming no setting (client review).
    from common.settings.schema import SettingsError
    from epd.client import Client

    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    monkeypatch.delenv("EPD_API_KEY", raising=False)
    monkeypatch.delenv("EPD_NAMESPACE", raising=False)
    (tmp_path / "epd").mkdir()
    key = tmp_path / "epd" / "client_key"
    for data, message in ((b"k\xc3\xa9y\n", "must be printable ASCII"), (b"k\xffy", "not UTF-8")):
        key.write_bytes(data)
        with pytest.raises(SettingsError, match=f"client_key: {message}"):
            Client("127.0.0.1:1")
    key.write_bytes(b"good-key\n")
    with pytest.raises(ValueError, match=r"tls_ca_file: cannot read /nope\.pem"):
        Client("127.0.0.1:1", tls_ca_file="/nope.pem")


def test_inputs_taken_before_are_still_taken():
    # Own-fix review 3: the new checks refused a video file given as a memoryview, a request
    # id of None, stop strings as any iterable, and a key file that begins with a BOM.
    video = {"type": "video", "video": memoryview(b"\x00\x00\x00\x18ftypmp42"), "fps": 1}
    request = build_request([{"role": "user", "content": [video]}], request_id=None, stop={"a"})
    assert request.messages[0].content[0].video.file.startswith(b"\x00") and request.request_id
    assert list(build_request([{"role": "user", "content": "hi"}], stop=iter(["x"])).stop) == ["x"]
    assert list(build_request([{"role": "user", "content": "hi"}], stop=None).stop) == []
    with pytest.raises(ValueError, match="request_id: expected a string"):
        build_request([{"role": "user", "content": "hi"}], request_id=0)  # not a random id


def test_a_key_file_saved_with_a_bom_is_read(tmp_path, monkeypatch):
    from common.settings.api_keys import default_api_key

    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    monkeypatch.delenv("EPD_API_KEY", raising=False)
    monkeypatch.delenv("EPD_NAMESPACE", raising=False)
    (tmp_path / "epd").mkdir()
    (tmp_path / "epd" / "client_key").write_bytes(b"\xef\xbb\xbfthe-key\r\n")
    assert default_api_key() == "the-key"


@pytest.mark.parametrize("keepalive_s", [0.05, 3601.0, 1.5e6, float("nan")])
def test_a_keepalive_grpc_cannot_take_is_refused_naming_it(keepalive_s):
    # 1.5e6 s failed at the first call with a bare OverflowError naming nothing: twice the
    # keepalive, in ms, is a C int option (s43diff review L2, s44).
    with pytest.raises(ValueError, match=r"keepalive_s must be None or 0\.1 to 3600 s"):
        Client("127.0.0.1:1", api_key="k", keepalive_s=keepalive_s)
