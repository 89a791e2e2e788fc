"""Request bodies of the HTTP API, in OpenAI's shapes (unknown fields are ignored).

Sampling follows OpenAI's defaults where they differ from the gRPC API's: `temperature`
defaults to 1.0. `max_tokens` (or `max_completion_tokens`) unset: the router's default.
`ignore_eos` is an extension (as in vLLM), sent with the `openai` client via `extra_body`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class MediaUrl(_Body):
    """`{"url": ...}`: a data URL, or (when the router allows it) a file path or https URL."""

    url: str
    detail: str | None = None  # OpenAI's image detail; ignored


class TextContent(_Body):
    """`{"type": "text", "text": ...}`."""

    type: Literal["text"]
    text: str


class ImageContent(_Body):
    """`{"type": "image_url", "image_url": {"url": ...}, "uuid": ...}`."""

    type: Literal["image_url"]
    image_url: MediaUrl
    uuid: str | None = None  # caller-supplied identity of the item


class VideoContent(_Body):
    """`{"type": "video_url", "video_url": {"url": ...}, "uuid": ..., "fps": ...}`: a
    container file (mp4, webm, mkv) the router decodes and samples at `fps`."""

    type: Literal["video_url"]
    video_url: MediaUrl
    uuid: str | None = None
    fps: float | None = Field(default=None, gt=0)  # None: the router's default


ContentPart = Annotated[TextContent | ImageContent | VideoContent, Field(discriminator="type")]


class ChatMessage(_Body):
    """One message: its content a string or a list of parts."""

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]


class StreamOptions(_Body):
    """`stream_options`: `include_usage` adds a last chunk with the usage only."""

    include_usage: bool = False


class SamplingBody(_Body):
    """The fields chat and text completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    ignore_eos: bool = False  # extension: keep generating past end-of-sequence
    user: str | None = None  # OpenAI's end-user id; ignored

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingBody):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingBody):
    """`POST /v1/completions`: a plain-text prompt, no chat template."""

    prompt: str
