"""Bad requests, refused before any worker is called with an error naming the field as the
caller spells it: the HTTP API's schema and conversion (a 400, never a 500; a parameter the
server does not implement is refused, not ignored; the router's gRPC field names become the
body's) and the router's image decoding (only the configured formats, no crash on a mangled
file). The same refusals from a running router, over HTTP and gRPC, are in
tests/test_bad_input_router.py, which builds its requests with this module's helpers (as do
tests/test_requests_in_flight.py and tests/test_tenant_share.py).

Found by sending malformed requests to a deployment. Before, over HTTP: a `max_tokens` past
uint32, a `top_k` past int32 or a lone surrogate failed when the protobuf message was built
(500); a part missing its `url` was reported as `content.str: Input should be a valid
string`; an image error named the gRPC field (`image.data`); `logprobs` and tools were
silently ignored; a chunked body over the limit got FastAPI's own error shape. Over gRPC:
a resume token outside the vocab and an empty `prompt` were refused only by a worker, after
prefill ran; `fps = inf` was taken; a media `uuid` and a `request_id` had no length bound,
and every block key of an item hashes its uuid (1 MiB of uuid: 1.4 s of hashing an 8k-token
prompt, in the router and again in prefill and decode).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import struct
from typing import Any

import numpy as np
import pydantic
import pytest
from PIL import Image

from common.errors import FieldError
from epd.v1 import router_service_pb2, sampling_pb2
from router.http.convert import chat_request, completion_request
from router.http.errors import ApiError, http_field, validation_error
from router.http.media import MediaPolicy
from router.http.schema import ChatCompletionRequest, CompletionRequest
from router.inputs import InputError, decode_image
from router.settings import RouterSettings
from tests.cluster import CLIENT_KEY
from tests.test_http_api import WEATHER, user

MODEL = "tiny"
TEXT_PART = {"type": "text", "text": "hi"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": WEATHER, **extra}


def png_url(width: int, height: int, format: str = "PNG") -> str:
    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format=format)
    return f"data:image/{format.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def refusal(body: dict[str, Any]) -> ApiError:
    """What the API answers a body its schema refuses."""
    with pytest.raises(pydantic.ValidationError) as err:
        ChatCompletionRequest.model_validate(body)
    # FastAPI's locations start with "body"; pydantic's own do not.
    return validation_error([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])


def parts(*content: dict[str, Any]) -> dict[str, Any]:
    """A chat body of one user message of these parts."""
    return chat(messages=user(*content))


C0, C1 = "messages[0].content[0]", "messages[0].content[1]"
VIDEO = {"type": "video_url", "video_url": {"url": "x"}, "fps": 0}
LONE = {"type": "image_url", "image_url": {"url": "\ud800"}}

# Body -> (param, a piece of the message).
SCHEMA_CASES: list[tuple[dict[str, Any], str, str]] = [
    (chat(max_tokens=1 << 32), "max_tokens", "4294967295"),
    (chat(max_completion_tokens=1 << 40), "max_completion_tokens", "4294967295"),
    (chat(top_k=1 << 40), "top_k", "2147483647"),
    (chat(temperature=1e300), "temperature", "finite float32 (at most about 3.4e38)"),
    (chat(seed=1 << 63), "seed", "from -2**63 to 2**63 - 1"),
    (chat(temperature=float("nan")), "temperature", "finite number"),
    (chat(top_p=-0.1), "top_p", "greater than or equal to 0"),
    (chat(stop=["\udc00"]), "stop[0]", "lone surrogate"),
    (chat(stop=5), "stop", "valid string or"),
    (chat(messages=[{"role": "user", "content": "\ud800"}]), "messages[0].content", "UTF-8"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "valid list"),
    (parts({"type": "text", "text": "a\ud800"}), f"{C0}.text", "surrogate"),
    (parts({"type": "image_url", "image_url": {}}), f"{C0}.image_url.url", "required"),
    (parts({"type": "text"}), f"{C0}.text", "required"),
    (parts(VIDEO), f"{C0}.fps", "greater than or equal to 0.001"),
    (parts({"type": "audio", "audio": "x"}), C0, "'audio'"),
    (parts(TEXT_PART, LONE), f"{C1}.image_url.url", "UTF-8"),
]


@pytest.mark.parametrize(("body", "param", "says"), SCHEMA_CASES)
def test_a_body_the_schema_refuses_names_its_field(
    body: dict[str, Any], param: str, says: str
) -> None:
    error = refusal(body)
    assert (error.status, error.param) == (400, param), str(error)
    assert says in str(error) and str(error).startswith(f"{param}: ")
    assert error.param is not None and ".str" not in error.param


def test_invalid_json_is_named_as_such() -> None:
    json_error = {
        "type": "json_invalid",
        "loc": ("body", 7),
        "msg": "JSON decode error",
        "ctx": {"error": "Expecting value"},
    }
    error = validation_error([json_error])
    assert (error.status, error.param) == (400, None)
    assert str(error) == "the body is not valid JSON: Expecting value (at character 7)"


def test_a_body_of_more_values_than_a_request_has_is_refused_before_parsing() -> None:
    # An array of zeros has no object to count while it parses: `json.loads` held the GIL,
    # and so the event loop, 6 s for 248 MiB.
    from router.http.parse import parse_body

    data = b'{"model": "m", "tools": [' + b"0," * 5000 + b'0], "messages": []}'
    with pytest.raises(ApiError, match="more than 4096 commas"):
        parse_body(data, "application/json", ChatCompletionRequest, max_commas=4096)
    text = {"model": "m", "messages": [{"role": "user", "content": "," * 5000}], "n": 1}
    assert parse_body(json.dumps(text).encode(), None, ChatCompletionRequest, 6000).n == 1


def test_a_body_json_cannot_read_says_why() -> None:
    from router.http.parse import parse_body

    for data, says in (
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "64 characters"),  # no field needs more
        (b'{"model": "\xff"}', "utf-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    ):
        with pytest.raises(ApiError) as err:
            parse_body(data, "application/json", ChatCompletionRequest)
        assert str(err.value).startswith("the body is not valid JSON") and says in str(err.value)


def test_the_widest_values_the_wire_carries_are_accepted() -> None:
    body = ChatCompletionRequest.model_validate(chat(max_tokens=(1 << 32) - 1, top_k=(1 << 31) - 1))
    request = chat_request(body, "r", MediaPolicy())
    assert (request.sampling.max_tokens, request.sampling.top_k) == ((1 << 32) - 1, (1 << 31) - 1)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_the_server_does_not_do_is_refused_not_ignored(
    extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(FieldError) as err:
        chat_request(ChatCompletionRequest.model_validate(chat(**extra)), "r", MediaPolicy())
    assert err.value.field == param
    allowed = chat(
        logprobs=False,
        tools=[],
        response_format={"type": "text"},
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
    )
    assert chat_request(ChatCompletionRequest.model_validate(allowed), "r", MediaPolicy())
    for field, value in (("echo", True), ("best_of", 2), ("logprobs", 2)):
        body = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", field: value})
        with pytest.raises(FieldError) as err:
            completion_request(body, "r")
        assert err.value.field == field


def test_grpc_field_names_become_the_bodys() -> None:
    assert http_field("messages[2].content[1].image.data") == "messages[2].content[1].image_url.url"
    assert http_field("messages[0].content[0].video.file") == "messages[0].content[0].video_url.url"
    assert http_field("messages[0].content[3].video.fps") == "messages[0].content[3].fps"
    assert http_field("sampling.max_tokens") == "max_tokens"
    assert http_field("stop") == "stop"
    error = ApiError.from_router(
        __import__("grpc").StatusCode.INVALID_ARGUMENT,
        "messages[0].content[0].image.data: is not a decodable image",
        (("epd-field", "messages[0].content[0].image.data"),),
    )
    assert error.param == "messages[0].content[0].image_url.url"
    assert str(error) == "messages[0].content[0].image_url.url: is not a decodable image"


def test_only_the_configured_image_formats_are_opened() -> None:
    """`[router] image_formats`: an image in another format is refused by its first bytes,
    naming its field; one an operator adds is decoded."""
    data = base64.b64decode(png_url(8, 8, "TIFF").partition(",")[2])
    field = "messages[0].content[0].image.data"
    limits = RouterSettings(model="m").input_limits(1024)
    with pytest.raises(InputError, match="image_formats") as err:
        decode_image(data, field, limits)
    assert err.value.field == field
    tiff = RouterSettings(model="m", image_formats=("png", "tiff")).input_limits(1024)
    assert tiff.image_formats == ("PNG", "TIFF")  # any case, as PIL names them
    assert decode_image(data, field, tiff).size == (8, 8)
    for name in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):  # what clients send, by default
        picture = base64.b64decode(png_url(8, 8, name).partition(",")[2])
        assert decode_image(picture, field, limits).size == (8, 8)


def test_a_tiff_whose_strip_offsets_are_fractions_is_not_a_decodable_image() -> None:
    """Found by decoding mutated files: PIL raised TypeError for it, which the router's
    decode errors did not include."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "TIFF")
    data = bytearray(buf.getvalue())
    order = "<" if data[:2] == b"II" else ">"
    (ifd,) = struct.unpack(order + "I", data[4:8])
    (count,) = struct.unpack(order + "H", data[ifd : ifd + 2])
    for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
        if struct.unpack(order + "H", data[entry : entry + 2]) == (273,):  # StripOffsets
            data[entry + 2 : entry + 4] = struct.pack(order + "H", 5)  # type RATIONAL
    with pytest.raises(InputError, match="is not a decodable image") as err:
        decode_image(bytes(data), "messages[0].content[0].image.data")
    assert err.value.field == "messages[0].content[0].image.data"


def repeated_scan_jpeg(side: int, repeats: int) -> bytes:
    """A progressive JPEG whose last scan comes `repeats` times: libjpeg only warns, and
    decodes each one over the whole image (~10 ms a scan at 4096x4096, 33 bytes each)."""
    buf = io.BytesIO()
    Image.new("L", (side, side), 128).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    start = data.rindex(b"\xff\xda")  # the last scan: its header and entropy-coded data
    end = data.rindex(b"\xff\xd9")  # the end of the image
    return data[:end] + data[start:end] * repeats + data[end:]


def test_a_jpeg_of_more_scans_than_any_encoder_writes_is_refused_before_decoding() -> None:
    from router.inputs import MAX_JPEG_SCANS

    field = "messages[0].content[0].image.data"
    limits = RouterSettings(model="m").input_limits(1024)
    assert decode_image(repeated_scan_jpeg(64, 8), field, limits).size == (64, 64)
    with pytest.raises(InputError, match="scans") as err:
        decode_image(repeated_scan_jpeg(64, MAX_JPEG_SCANS), field, limits)
    assert err.value.field == field


# ------------------- requests for a router (tests/test_bad_input_router.py and other modules)


def post_raw(url: str, data: bytes, *, chunked: bool = False) -> tuple[int, dict[str, Any]]:
    """POST `data` to the chat endpoint (as one body, or in 64 KiB chunks without a
    Content-Length); the status and JSON body."""
    host = url.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=30)
    headers = {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"}
    try:
        if chunked:
            pieces = (data[i : i + (1 << 16)] for i in range(0, len(data), 1 << 16))
            conn.request("POST", "/v1/chat/completions", pieces, headers, encode_chunked=True)
        else:
            conn.request("POST", "/v1/chat/completions", data, headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def grpc_request(**fields: Any) -> router_service_pb2.GenerateRequest:
    request = router_service_pb2.GenerateRequest(
        messages=[router_service_pb2.ChatMessage(role="user")],
        sampling=sampling_pb2.SamplingParams(max_tokens=4),
    )
    request.MergeFrom(router_service_pb2.GenerateRequest(**fields))
    return request
