"""Request bodies of the HTTP API, in OpenAI's shapes (unknown fields are ignored).

Sampling follows OpenAI's defaults where they differ from the gRPC API's: `temperature`
defaults to 1.0. `max_tokens` (or `max_completion_tokens`) unset: a chat runs to its end, up to
`[router] chat_max_tokens` (or the checkpoint's `max_new_tokens`, if less) or the context the
prompt leaves (`router.http.app`); a completion gets the checkpoint's `max_new_tokens`, else
16 (OpenAI's).
`ignore_eos` and `cache_salt` are extensions (as in vLLM), sent with the `openai` client via
`extra_body`; `cache_salt` is the gRPC API's (mixed into the tenant's: docs/security.md).

Every bound the wire's messages have is checked here, so a value they cannot carry is a 400
naming its field, not a failure later: counts fit their protobuf integers, `temperature` a
float32, and every string is valid UTF-8 (JSON can spell lone surrogates, protobuf strings
cannot hold them). OpenAI fields for what this server does not do (`logprobs`, tools, a
`response_format` other than text, `echo`, `best_of` above 1) are named so that asking for
them is refused (`router.http.convert.refuse_unsupported`) rather than silently ignored,
and so are the penalties and `logit_bias` (0 and empty, what some clients always send, are
accepted). An explicit `null` for an optional field means it is unset (OpenAI's fields are
nullable): `_Body._null_is_unset`. The fields this server accepts and ignores, each with
why, are `ACCEPTED_AND_IGNORED`.

Types are JSON's, strictly (`_Body`): a boolean or an integer is not read from a string or
from the other (`"stream": "yes"` or `"max_tokens": true` is a 400 naming the field, as
OpenAI answers, not a stream or a 1-token answer). A float field takes a JSON integer, and an
integer field a whole number written as a float (`3.0`, which Python clients send for a
computed count; pydantic's lax mode and vLLM take it too): `Int`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)
from pydantic_core import PydanticCustomError

from common.multimodal.validation import INT32_MAX
from common.processing.limits import MAX_FPS, MIN_FPS
from common.sampling import MAX_STOP_TOKEN_IDS
from router.ids import MAX_ID_CHARS

UINT32_MAX = (1 << 32) - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"is not valid UTF-8 (a lone surrogate at character {exc.start})"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]  # a string the wire's protobuf strings can hold


def _whole(value: Any) -> Any:
    if not isinstance(value, float):
        return value
    if not value.is_integer():
        raise PydanticCustomError(
            "int_from_float", "Input should be a valid integer, got a number with a fractional part"
        )
    return int(value)


Int = Annotated[int, BeforeValidator(_whole)]  # a JSON integer, or a whole number as `3.0`


# Bounds named as they are: pydantic's own messages print 2**63 as 9223372036854776000 and
# the largest float32 in 39 digits.
def _int64(value: int) -> int:
    if not -(2**63) <= value < 2**63:
        raise ValueError("must be a 64-bit signed integer (from -2**63 to 2**63 - 1)")
    return value


def _float32(value: float) -> float:
    if value > FLOAT32_MAX:
        raise ValueError("must be a finite float32 (at most about 3.4e38)")
    return value


# OpenAI's fields this server accepts and ignores, with why: none changes the answer's text.
# (What would change it, or claims something the answer does not do, is refused instead.)
ACCEPTED_AND_IGNORED: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; `cache_salt` splits caches here",
    "metadata": "tags for OpenAI's stored completions and dashboards; nothing is stored",
    "service_tier": "OpenAI's billing and latency tier; this server has one",
    "reasoning_effort": "the served model has no reasoning mode to configure",
    "verbosity": "a hint to OpenAI's reasoning models; the served model has none",
    "prompt_cache_key": "OpenAI's cache routing hint; the router routes by prefix itself",
    "prompt_cache_retention": "likewise; the KV cache here keeps blocks by its own policy",
    "prompt_cache_options": "likewise",
    "parallel_tool_calls": "tool calls are refused (`tools`), so there are none to run",
    "messages[].name": "a speaker's name; the chat template has no place for it",
    "image_url.detail": "one of auto, low, high (checked); an image's resolution is its own",
}


class _Body(BaseModel):
    # Unknown fields: ignored (`ACCEPTED_AND_IGNORED`). Strict: JSON's types (the docstring).
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit `null` for a field that has a default means the default, as OpenAI
        reads its nullable fields (`"n": null`, `"stream": null`; clients that serialize
        every field send them). A required field's `null` is still refused, naming it."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


class MediaUrl(_Body):
    """`{"url": ...}`: a data URL, or (when the router allows it) a file path or https URL."""

    url: Text
    # OpenAI's image detail: checked, not used (the image is read at its own resolution,
    # within the checkpoint's pixel bounds, whatever it says).
    detail: Literal["auto", "low", "high"] | None = None


class TextContent(_Body):
    """`{"type": "text", "text": ...}`."""

    type: Literal["text"]
    text: Text


class ImageContent(_Body):
    """`{"type": "image_url", "image_url": {"url": ...}, "uuid": ...}`."""

    type: Literal["image_url"]
    image_url: MediaUrl
    uuid: Text | None = None  # caller-supplied identity of the item


class VideoContent(_Body):
    """`{"type": "video_url", "video_url": {"url": ...}, "uuid": ..., "fps": ...}`: a
    container file (mp4, webm, mkv) the router decodes and samples at `fps` (the model's
    processor then keeps at most its own rate of those frames: 2 a second for Qwen3-VL)."""

    type: Literal["video_url"]
    video_url: MediaUrl
    uuid: Text | None = None
    # None: the router's default. Bounded here, before the wire's float32 rounds it.
    fps: float | None = Field(default=None, ge=MIN_FPS, le=MAX_FPS)


ContentPart = Annotated[TextContent | ImageContent | VideoContent, Field(discriminator="type")]


class ChatMessage(_Body):
    """One message: its content a string or a list of parts."""

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | Annotated[list[ContentPart], Field(min_length=1)]  # as OpenAI: no []
    # An assistant's, as OpenAI returns them: refused unless empty (`refuse_unsupported`),
    # the template has no place for them (openai s44 review F2: dropped from the prompt).
    tool_calls: list[Any] | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None
    # vLLM's (an answer's reasoning, which Qwen3-style templates write back): refused where
    # the chat template renders the chat otherwise with it (`router.http.template_inputs`).
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(_Body):
    """`stream_options`: `include_usage` adds a last chunk with the usage only."""

    include_usage: bool = False


class SamplingBody(_Body):
    """The fields chat and text completions share."""

    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: (
        Annotated[float, Field(ge=0, allow_inf_nan=False), AfterValidator(_float32)] | None
    ) = None
    # 0 (as OpenAI takes it) keeps the likeliest token only: sent as the smallest float32
    # past 0 (`router.http.convert.sampling`), which does the same.
    top_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_k: Int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1 or 0: off
    # Any int64, as vLLM takes: -1 is unset (a random seed), another negative one is taken
    # modulo 2**63 (`router.http.convert.sampling`).
    seed: Annotated[Int, AfterValidator(_int64)] | None = None
    # Both set: they must agree (`router.http.convert.sampling`).
    max_tokens: Int | None = Field(default=None, ge=1, le=UINT32_MAX)
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=UINT32_MAX)
    stop: Text | list[Text] | None = None
    n: Int = Field(default=1, ge=1)  # refused above 1: one choice per request
    ignore_eos: bool = False  # extension: keep generating past end-of-sequence
    # Extension (as in vLLM): splits the caller's cache further, as `GenerateRequest.cache_salt`.
    cache_salt: (
        Annotated[
            str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS), AfterValidator(_utf8)
        ]
        | None
    ) = None
    user: str | None = None  # OpenAI's end-user id; ignored
    echo: bool = False  # refused when true (chat: vLLM's, the last message said again)
    best_of: Int | None = None  # refused above 1
    # Not done by this server: refused when asked for (see the module docstring).
    logprobs: bool | Int | None = None  # chat: a bool; completions: a count
    top_logprobs: Int | None = None
    presence_penalty: float | None = None  # refused unless 0
    frequency_penalty: float | None = None  # refused unless 0
    logit_bias: dict[str, float] | None = None  # refused when not empty
    # vLLM's extensions: `stop_token_ids` is done; the others are refused unless neutral.
    stop_token_ids: list[Annotated[Int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS
    )
    repetition_penalty: float | None = None  # refused unless 1
    min_p: float | None = None  # refused unless 0
    min_tokens: Int | None = None  # refused unless 0
    bad_words: list[str] | None = None  # refused when not empty
    include_stop_str_in_output: bool = False  # refused when true
    prompt_logprobs: Int | None = None  # refused when set
    use_beam_search: bool = False  # refused when true
    guided_json: Any = None  # guided decoding (structured output): refused when set
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    structural_tag: Any = None
    # vLLM's that would change the answer (they were ignored: sampling review M1, s44):
    # refused unless neutral.
    allowed_token_ids: list[Any] | None = None  # refused when set
    typical_p: float | None = None  # refused unless 1
    skip_special_tokens: bool = True  # refused when false (their text is left out)
    truncate_prompt_tokens: Any = None  # refused when set (a prompt is never cut here)
    logits_processors: Any = None  # refused when set
    vllm_xargs: Any = None  # refused when set
    response_format: dict[str, Any] | None = None  # only {"type": "text"}

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingBody):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None  # refused when not empty (no tool calls)
    functions: list[Any] | None = None  # the older name of `tools`
    # Refused unless neutral (`router.http.convert.refuse_unsupported`): a forced tool call,
    # audio out, predicted output; vLLM's chat-template switches.
    tool_choice: Any = None  # "none" or "auto" only
    function_call: Any = None  # the older name of `tool_choice`
    modalities: list[str] | None = None  # ["text"] only
    audio: Any = None
    prediction: Any = None
    # OpenAI's: asked for, they would not be done, and the answer would not say so (a web
    # search, a moderation pass; a stored completion there is no endpoint to fetch).
    web_search_options: Any = None  # refused when set (`{}` asks for a search too)
    moderation: Any = None  # refused when set
    store: bool = False  # refused when true
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes them
    chat_template: Any = None  # refused when set: the checkpoint's template is used
    # A key the chat template reads is refused, one it does not is ignored (it cannot
    # change the prompt): `router.http.template_inputs`.
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None  # vLLM's, for RAG templates: likewise, where read
    mm_processor_kwargs: dict[str, Any] | None = None  # refused when not empty


class CompletionRequest(SamplingBody):
    """`POST /v1/completions`: a plain-text prompt, no chat template."""

    prompt: Text
    suffix: str | None = None  # refused when not empty
