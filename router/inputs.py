"""The router's edge: a `GenerateRequest` checked and turned into processor input.

Everything a client sends is validated here, before any worker sees the request: each
media payload is decoded (a payload PIL cannot open is an error naming its field, e.g.
`messages[0].content[1].image.data`), and the sampling parameters are checked and
normalised (proto3 zeros mean "default").

Limits come before work (`common.processing.limits.InputLimits`, from the router's
settings): text bytes are counted before anything is tokenized; a video's frame count
before any frame is opened; every image and frame is opened lazily, its header's size
checked, and what the request's media take decoded summed from the headers, before any is
decoded. A video may come as a container file (`VideoInput.file`: mp4, webm, mkv), opened by
`common.processing.video_file.open_video`: its bytes, frame size and duration checked from
its headers, and what it will take counted in the same budget, before anything is decoded;
it is sampled at the request's `fps` (0: `video_file_fps`) with the container's times, and
only the frames the processor samples of those (at most its `video_sample_fps`) are kept,
resized as they decode. With the processor's processed-image cache, a video's frames are
keyed by their bytes (`common.processing.video_cache`) and only those of temporal patches
the cache does not hold are decoded: the same video with frames appended decodes the new
frames alone. The chat becomes typed `Message`s here, once (`common.processing.messages`);
nothing after this reads the protobuf or a dict. Errors are `InputError`s (a `ValueError`),
which the server answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from PIL import Image

from common.errors import FieldError
from common.multimodal.validation import MAX_UUID_CHARS
from common.processing.image import KeyedImage, bytes_per_pixel, check_aspect_ratio, release_decoder
from common.processing.limits import (
    MAX_FPS,
    MAX_IMAGE_PIXELS,
    MIN_FPS,
    InputLimits,
    LimitError,
    MediaBudget,
    check_image_header,
    check_text_bytes,
    check_video_frames,
)
from common.processing.messages import ImagePart, Message, Part, TextPart, VideoPart
from common.processing.video_cache import frames_to_decode
from common.processing.video_file import VideoFile, open_video
from epd.v1 import router_service_pb2
from router.media_cost import MediaCost

if TYPE_CHECKING:
    from common.processing.processor import Processor

# Frames one video file may give when no max_video_frames is set.
DEFAULT_MAX_VIDEO_FRAMES = 768


class InputError(ValueError):
    """A malformed request; `field` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ContextTooLong(InputError):
    """The prompt, or the prompt with `max_tokens`, does not fit the model's context."""


# A JPEG's scans (start-of-scan markers; entropy-coded data never holds one): encoders write
# up to ~12, and libjpeg decodes each over the whole image, so a small file repeating one
# took ~10 ms a scan at 4096x4096. The count is an upper bound (a thumbnail's count too).
MAX_JPEG_SCANS = 100

# TypeError too: PIL raises it on some malformed TIFF tags (found by decoding mutated files).
_DECODE_ERRORS = (
    OSError,
    ValueError,
    TypeError,
    SyntaxError,
    Image.DecompressionBombError,
    Warning,
)


def open_image(
    data: bytes, field: str, limits: InputLimits, budget: MediaBudget | None = None
) -> Image.Image:
    """Open one encoded image lazily (PIL reads only its header) and check its size, and
    its decoded bytes against `budget` (at the peak of decoding it, `bytes_per_pixel`;
    a video frame's EXIF turn counted too, though frames are not turned); `InputError`
    naming `field`. Nothing is decoded."""
    if not data:
        raise InputError(field, "is empty")
    formats = limits.image_formats
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=formats)
    except Image.UnidentifiedImageError:
        if formats is None:
            raise InputError(field, "is not a decodable image (not a format PIL reads)") from None
        raise InputError(
            field,
            f"is not an image in a format this server decodes ({', '.join(formats)}: "
            "[router] image_formats)",
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # PIL's own bound, checked as it opens: above max_image_pixels, whose cap is lower.
        raise InputError(field, f"has more pixels than max_image_pixels allows ({exc})") from None
    except _DECODE_ERRORS as exc:
        raise InputError(field, f"is not a decodable image ({exc})") from None
    try:
        check_image_header(image, limits, field)
        if image.width * image.height > MAX_IMAGE_PIXELS:  # with no max_image_pixels given
            raise InputError(
                field,
                f"image of {image.width}x{image.height} is past the {MAX_IMAGE_PIXELS} pixels "
                "a server decodes",
            )
        if budget is not None:
            budget.add(image.width, image.height, field, *bytes_per_pixel(image))
    except LimitError as exc:
        raise InputError(exc.field, exc.reason) from None
    try:
        check_aspect_ratio(image.height, image.width)
    except ValueError as exc:  # a size the model's resize refuses
        raise InputError(field, str(exc)) from None
    if image.format == "JPEG" and data.count(b"\xff\xda") > MAX_JPEG_SCANS:
        raise InputError(field, f"is a JPEG of more than {MAX_JPEG_SCANS} scans")
    return image


def load_image(image: Image.Image, field: str) -> Image.Image:
    """Decode an image `open_image` opened, its decoder let go; `InputError` naming `field`
    when it cannot."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except _DECODE_ERRORS as exc:
        raise InputError(field, f"is not a decodable image ({exc})") from None
    release_decoder(image)
    return image


def decode_image(data: bytes, field: str, limits: InputLimits | None = None) -> Image.Image:
    """Open, check and fully decode one encoded image; `InputError` naming `field`."""
    return load_image(open_image(data, field, limits or InputLimits()), field)


def messages_from_proto(
    messages: Any,  # RepeatedCompositeFieldContainer[ChatMessage]
    limits: InputLimits | None = None,
    processor: Processor | None = None,
    cache_salt: str | None = None,
    reserve: Callable[[int], object] | None = None,
    ended: Callable[[], bool] | None = None,
) -> tuple[Message, ...]:
    """The typed chat, media decoded to PIL images; `InputError` naming the field.
    `ended()`, asked while video files decode, stops them once the request has ended.

    Every limit is checked, for the whole request, before any image is decoded; then
    `reserve` (when given) is called with the bytes its media decode to, from their
    headers, and may raise to refuse the request before anything is decoded. With a
    `processor` that has an `image_cache`, an image part becomes a `KeyedImage` (its bytes
    and their cache key), decoded only when the cache does not hold that key: bytes the
    processor has already processed were decodable then, so they are not decoded again.
    The key covers `cache_salt` (the tenant's): tenants never share entries."""
    if not messages:
        raise InputError("messages", "is empty")
    reader = _Reader(limits or InputLimits(), processor, cache_salt)
    try:
        chat: list[tuple[str, list[Part | _FileVideo]]] = []
        for i, message in enumerate(messages):
            if message.role not in ROLES:  # what the wire says; a template renders any
                shown = repr(message.role[:32]) if message.role else "empty"
                raise InputError(f"messages[{i}].role", f"is {shown}: expected {', '.join(ROLES)}")
            reader.text(message.role, f"messages[{i}].role")  # counted as the prompt's text
            parts = [
                reader.part(part, f"messages[{i}].content[{j}]")
                for j, part in enumerate(message.content)
            ]
            chat.append((message.role, parts))
        if reserve is not None and reader.budget.total:
            reserve(reader.budget.total)
        for image, field in reader.opened:
            load_image(image, field)
        return tuple(
            Message(role, tuple(p.decode(ended) if isinstance(p, _FileVideo) else p for p in parts))
            for role, parts in chat
        )
    finally:
        for video in reader.files:
            video.file.close()


class _FileVideo:
    """A video file opened and checked, decoded once every limit of the request held."""

    def __init__(self, file: VideoFile, uuid: str | None) -> None:
        self.file = file
        self.uuid = uuid

    def decode(self, ended: Callable[[], bool] | None = None) -> VideoPart:
        try:
            frames = self.file.decode(ended)
        except FieldError as exc:
            raise InputError(exc.field, exc.reason) from None
        return VideoPart(frames, frames.fps, uuid=self.uuid)


class _Reader:
    """One request's parts, read under its limits; images opened, decoded only later."""

    def __init__(
        self, limits: InputLimits, processor: Processor | None = None, salt: str | None = None
    ) -> None:
        self.limits = limits
        self.salt = salt  # the request's cache salt, part of every processed-image key
        # Keys images for the processor's processed-image cache (None: no cache).
        self.processor = (
            processor if processor is not None and processor.image_cache is not None else None
        )
        self.budget = MediaBudget(limits)
        self.cost = MediaCost(processor.settings if processor else None, limits, self.budget)
        self.text_bytes = 0  # UTF-8 bytes of the roles and text parts so far
        self.opened: list[tuple[Image.Image, str]] = []  # images to decode, with their fields
        self.files: list[_FileVideo] = []  # video files to decode (closed when done)

    def text(self, text: str, field: str) -> None:
        self.text_bytes += len(text.encode())
        try:
            check_text_bytes(self.text_bytes, self.limits, field)
        except LimitError as exc:
            raise InputError(exc.field, exc.reason) from None

    def image(self, data: bytes, field: str) -> Image.Image:
        image = self._open_still(data, field)
        self.opened.append((image, field))
        return image

    def _open_still(self, data: bytes, field: str) -> Image.Image:
        """An image part opened and checked, its processed size counted (`MediaCost`)."""
        self.budget.begin()
        image = open_image(data, field, self.limits, self.budget)
        try:
            self.cost.image(image.width, image.height, field)
        except LimitError as exc:
            raise InputError(exc.field, exc.reason) from None
        return image

    def still(self, data: bytes, field: str) -> Image.Image | KeyedImage:
        """An image part: opened and checked as any image, then keyed for the processor's
        cache; not decoded when the cache holds it (see `messages_from_proto`)."""
        processor = self.processor
        if processor is None:
            return self.image(data, field)
        image = self._open_still(data, field)
        key = processor.image_key(data, self.salt)
        assert processor.image_cache is not None
        if key in processor.image_cache:
            image.close()
            return KeyedImage(data, key)
        self.opened.append((image, field))
        return KeyedImage(data, key, image)

    def part(self, part: router_service_pb2.ContentPart, where: str) -> Part | _FileVideo:
        kind = part.WhichOneof("content")
        if kind == "text":
            self.text(part.text, f"{where}.text")
            return TextPart(part.text)
        if kind == "image":
            uuid = _uuid(part.image, f"{where}.image.uuid")
            return ImagePart(self.still(part.image.data, f"{where}.image.data"), uuid=uuid)
        if kind == "video":
            return self.video(part.video, where)
        raise InputError(where, "has no text, image or video")

    def video(self, video: router_service_pb2.VideoInput, where: str) -> VideoPart | _FileVideo:
        uuid = _uuid(video, f"{where}.video.uuid")
        file = video.file  # read once: each read copies it (200 MiB: 0.13 s, GIL held)
        if file and video.frames:
            raise InputError(f"{where}.video", "set exactly one of frames and file")
        if file:
            return self.video_file(video, file, where)
        if not video.frames:  # (an empty `file` reads as none)
            raise InputError(f"{where}.video", "has neither frames nor a file (or it is empty)")
        try:
            check_video_frames(len(video.frames), self.limits, f"{where}.video.frames")
        except LimitError as exc:
            raise InputError(exc.field, exc.reason) from None
        if not MIN_FPS <= video.fps <= MAX_FPS:
            raise InputError(
                f"{where}.video.fps",
                f"must be from {MIN_FPS:g} to {MAX_FPS:g}, got {video.fps:g}",
            )
        data = list(video.frames)  # read once: each read copies every frame (ownfixC C7)
        fields = [f"{where}.video.frames[{k}]" for k in range(len(data))]
        self.budget.begin()
        opened = [
            open_image(frame, field, self.limits, self.budget)
            for frame, field in zip(data, fields, strict=True)
        ]
        odd = next((k for k, f in enumerate(opened) if f.size != opened[0].size), None)
        if odd is not None:  # the first frame of another size named (s42 media review L4)
            sizes = f"{opened[odd].size} against {opened[0].size}"
            raise InputError(fields[odd], f"differs in size from frame 0 ({sizes})")
        fps = float(video.fps)
        try:
            self.cost.video(len(opened), fps, *opened[0].size, f"{where}.video.frames")
        except LimitError as exc:
            raise InputError(exc.field, exc.reason) from None
        frames = self.keyed_frames(data, opened, fps)
        if frames is None:  # no processed-partition cache: every frame is decoded
            self.opened.extend(zip(opened, fields, strict=True))
        else:
            needed = [k for k, f in enumerate(frames) if f.image is not None]
            self.opened.extend((opened[k], fields[k]) for k in needed)
        return VideoPart(opened if frames is None else frames, fps, uuid=uuid)

    def keyed_frames(
        self, data: list[bytes], opened: list[Image.Image], fps: float
    ) -> list[KeyedImage] | None:
        """A video's frames keyed for the processor's cache of processed temporal patches
        (`common.processing.video_cache`), each with its image where a patch it belongs to
        is not cached (to be decoded) and without it where every one is (not decoded, its
        image closed); None without a cache (or when the video cannot be planned, which the
        processor then reports)."""
        processor = self.processor
        if processor is None or processor.image_cache is None:
            return None
        keys = [processor.image_key(frame, self.salt) for frame in data]
        width, height = opened[0].size
        try:
            needed = frames_to_decode(
                keys, fps, width, height, processor.settings, processor.image_cache
            )
        except ValueError:
            return None
        out = []
        for k, (frame, key, image) in enumerate(zip(data, keys, opened, strict=True)):
            if k in needed:
                out.append(KeyedImage(frame, key, image))
            else:
                image.close()
                out.append(KeyedImage(frame, key))
        return out

    def video_file(
        self, video: router_service_pb2.VideoInput, file: bytes, where: str
    ) -> _FileVideo:
        if video.fps != 0 and not MIN_FPS <= video.fps <= MAX_FPS:
            raise InputError(
                f"{where}.video.fps",
                f"must be 0 (the router's video_file_fps) or from {MIN_FPS:g} to "
                f"{MAX_FPS:g}, got {video.fps:g}",
            )
        field = f"{where}.video.file"
        limits = self.limits
        fps = video.fps or limits.video_file_fps
        try:
            opened = open_video(
                file,
                fps=fps,
                max_frames=limits.max_video_frames or DEFAULT_MAX_VIDEO_FRAMES,
                max_pixels=MAX_IMAGE_PIXELS
                if limits.max_image_pixels is None
                else min(limits.max_image_pixels, MAX_IMAGE_PIXELS),
                max_bytes=limits.max_video_file_bytes,
                max_seconds=limits.max_video_seconds,
                max_decoded_pixels=limits.max_video_decoded_pixels,
                field=field,
                planner=self.cost.planner(),
            )
        except FieldError as exc:
            raise InputError(exc.field, exc.reason) from None
        pending = _FileVideo(opened, _uuid(video, f"{where}.video.uuid"))
        self.files.append(pending)
        try:
            self.cost.video_file(opened.header, fps, field)
        except LimitError as exc:
            raise InputError(exc.field, exc.reason) from None
        return pending


def _uuid(media: Any, field: str) -> str | None:
    """An image's or video's caller-supplied `uuid` (None: unset or empty, as on the wire);
    InputError naming `field` when longer than block keys may hash (`MAX_UUID_CHARS`)."""
    if not media.HasField("uuid") or not media.uuid:
        return None
    if len(media.uuid) > MAX_UUID_CHARS:
        raise InputError(field, f"is over {MAX_UUID_CHARS} characters")
    return str(media.uuid)


ROLES = ("system", "user", "assistant")  # a chat message's, as the wire names them
