"""A checkpoint's own Jinja2 chat template, rendered into the processor's pieces.

Where the template comes from, first found wins: `chat_template.jinja`, then
`chat_template.json` (`{"chat_template": ...}`), then the `chat_template` key of
`processor_config.json`, then of `tokenizer_config.json` (a string, or the list of named
templates transformers accepts, of which `default` is taken). A checkpoint with none (the
built-in tiny ones) uses the built-in ChatML layout of `common.processing.chat`.

Rendering is `transformers`' `apply_chat_template`: a sandboxed
`ImmutableSandboxedEnvironment` (`trim_blocks`, `lstrip_blocks`, the `tojson` filter,
`raise_exception`, `strftime_now`, loop controls), called with `messages`,
`add_generation_prompt`, `tools=None` and the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) when given.

User text must stay text, yet the template's output is one string mixing its control
tokens with user text. So before rendering, every special token spelled in a role or a text
part (and the marker characters themselves) is replaced by a marker (`\ue000<n>\ue001`,
private-use characters no template treats specially); the template sees the user's text
otherwise unchanged, so its `trim`, `startswith` or `'</think>' in content` behave as in
`transformers`. Media parts are given as `{"type": "image"}` / `{"type": "video"}`. The
rendered string is then cut into pieces: a marker becomes the literal text it hid (a `str`,
tokenized with special tokens as plain text), a `<|vision_start|><|image_pad|><|vision_end|>`
(or `video_pad`) run becomes the next media part of that modality (the processor expands it
exactly as with the built-in layout, so the runs are the same), any other added token of the
tokenizer becomes a `Control` (non-special added tokens in user text, such as `<think>`,
are tokens there too, as with the built-in layout), and the rest is text. A message's
content is passed as a string when it is one text part, as the list form otherwise.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import meta
from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer

from common.errors import CheckpointError
from common.models.checkpoint_files import read_checkpoint_object, read_checkpoint_text
from common.multimodal.params import Modality
from common.processing.chat import Control, Piece
from common.processing.messages import ImagePart, MediaPart, Message, TextPart, VideoPart
from common.processing.template_sandbox import BoundedSandbox, RenderBudget, budget, new_budget

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_JSON = "chat_template.json"
logger = logging.getLogger(__name__)

# Whatever a template's own code raises (`range(10**9)` is an OverflowError in the sandbox)
# is the template's failure to render a request, not a crash.
_FAILURES = (TemplateError, ArithmeticError, LookupError, RecursionError, TypeError, MemoryError)

_KEY_FILES = ("processor_config.json", "tokenizer_config.json")
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MEDIA = {
    "<|vision_start|><|image_pad|><|vision_end|>": Modality.IMAGE,
    "<|vision_start|><|video_pad|><|vision_end|>": Modality.VIDEO,
}
_BARE_PADS = ("<|image_pad|>", "<|video_pad|>")

# The chats rendered once at load, text only then with an image: a template that fails on
# the first, leaves out its user text or takes longer than CHECK_SECONDS would fail (or
# stall) every request.
CHECK_SECONDS = 10.0
CHECK_USER_TEXT = "Describe this image."
_CHECK_SYSTEM = Message("system", (TextPart("You are a helpful assistant."),))
_CHECK_ANSWER = (
    Message("assistant", (TextPart("A cat on a mat."),)),
    Message("user", (TextPart("Thanks."),)),
)
CHECK_CHATS = (
    (_CHECK_SYSTEM, Message("user", (TextPart(CHECK_USER_TEXT),)), *_CHECK_ANSWER),
    (
        _CHECK_SYSTEM,
        Message("user", (ImagePart(data=b""), TextPart(CHECK_USER_TEXT))),
        *_CHECK_ANSWER,
    ),
)


def find_chat_template(folder: str | Path) -> str | None:
    """The checkpoint's chat template source, or None (see the module docstring)."""
    found = _find_template(Path(folder))
    return None if found is None else found[0]


def _find_template(folder: Path) -> tuple[str, str] | None:
    """The template source and where it was found (a path, and the key in a JSON file)."""
    if (folder / TEMPLATE_FILE).exists():
        return read_checkpoint_text(folder / TEMPLATE_FILE), str(folder / TEMPLATE_FILE)
    for name in (TEMPLATE_JSON, *_KEY_FILES):
        raw = read_checkpoint_object(folder / name)
        template = None if raw is None else raw.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template, f"{folder / name}: chat_template"
    return None


class ChatTemplate:
    """One compiled Jinja2 chat template; `render` is safe to call from many threads."""

    def __init__(
        self,
        source: str,
        *,
        added_tokens: Iterable[str] = (),
        special_tokens: Iterable[str] = (),
        variables: Mapping[str, str] | None = None,
        origin: str = "chat template",
    ) -> None:
        """`added_tokens`: the tokenizer's added tokens, cut out of the output as
        `Control`s (the `<|vision_start|>` + pad runs are matched first).
        `special_tokens`: those hidden from the template when typed in user text (the
        tokenizer's special ones). `variables`: template variables such as `eos_token`.
        `origin`: where the source was found, named by errors. Raises `CheckpointError`
        when the source does not compile."""

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self.origin = origin
        try:
            self._template = env.from_string(source)
            # The names it reads from its context (`messages`, `tools`, `enable_thinking`,
            # ...): a variable it does not read cannot change what it renders.
            self.reads = frozenset(meta.find_undeclared_variables(env.parse(source)))
        except (TemplateError, RecursionError, MemoryError) as exc:
            raise CheckpointError(f"{origin}: does not compile: {exc!r}") from None
        self._variables = dict(variables or {})
        self._hide = re.compile(longest_of({*special_tokens, *_BARE_PADS, _MARK_OPEN, _MARK_CLOSE}))
        alternatives = [re.escape(m) for m in _MEDIA]
        alternatives.append(f"{_MARK_OPEN}[0-9]+{_MARK_CLOSE}")
        alternatives.append(longest_of({*added_tokens, *_BARE_PADS}))
        self._splitter = re.compile("(" + "|".join(alternatives) + ")")

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        limits: RenderBudget | None = None,
    ) -> list[Piece]:
        """The prompt as text, control-token and media pieces in order, like
        `common.processing.chat.render_chat`. Raises `ValueError` when the template fails
        (its `raise_exception` included, or an error its own code makes) or places media it
        was not given. `limits`: what the render may spend (default: `new_budget()`)."""
        texts: list[str] = []
        media: dict[Modality, list[MediaPart]] = {Modality.IMAGE: [], Modality.VIDEO: []}
        dicts = [self._message_dict(m, texts, media) for m in messages]
        rendered = self.render_text(dicts, add_generation_prompt, limits)
        return self._pieces(rendered, texts, media)

    def render_text(
        self, dicts: list[dict[str, Any]], add_generation_prompt: bool, limits: RenderBudget | None
    ) -> str:
        """The template's text for messages as it is given them (`dicts`, as `render` makes
        them); `ValueError` when the template fails (`render`)."""
        try:
            with budget(limits):  # bounded time, loop steps and repetition (template_sandbox)
                return self._template.render(
                    messages=dicts,
                    add_generation_prompt=add_generation_prompt,
                    tools=None,
                    documents=None,
                    **self._variables,
                )
        except _FAILURES as exc:
            raise ValueError(f"chat template: {exc!r}") from exc

    def check(self, timeout_s: float = CHECK_SECONDS) -> None:
        """Render `CHECK_CHATS` once, as at load; raise `CheckpointError` naming `origin`
        when the template fails on the text chat, leaves out its user text, or the renders
        take over `timeout_s`. Failing only on the chat with an image (a text-only
        template) is warned about: image requests will be refused, text ones served.

        The renders run in a daemon thread so that one whose loops the sandbox cannot stop
        (see `common.processing.template_sandbox`) still fails the check in time; it is
        told to stop and left behind."""
        outcome: list[list[Piece] | Exception] = []

        def run() -> None:
            for chat in CHECK_CHATS:
                try:
                    outcome.append(self.render(chat, limits=limits))
                except Exception as exc:  # handed to the caller below
                    outcome.append(exc)

        limits = new_budget(timeout_s)
        thread = threading.Thread(target=run, name="chat-template-check", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive() or len(outcome) < len(CHECK_CHATS):
            limits.stop = True
            raise CheckpointError(
                f"{self.origin}: rendering a short test chat took more than {timeout_s:g} s"
            )
        text_only, with_image = outcome
        if isinstance(text_only, Exception):
            raise CheckpointError(f"{self.origin}: fails on a short test chat: {text_only}")
        text = "".join(p for p in text_only if isinstance(p, str))
        if CHECK_USER_TEXT not in text:
            raise CheckpointError(
                f"{self.origin}: renders a short test chat without its user text "
                f"(rendered {text[:80]!r})"
            )
        if isinstance(with_image, Exception):
            logger.warning(
                "%s: fails on a chat with an image (%s); requests with images will be refused",
                self.origin,
                with_image,
            )

    def _escape(self, text: str, texts: list[str]) -> str:
        """`text` with each special token (and marker character) replaced by a marker."""

        def mark(match: re.Match[str]) -> str:
            texts.append(match.group(0))
            return f"{_MARK_OPEN}{len(texts) - 1}{_MARK_CLOSE}"

        return self._hide.sub(mark, text)

    def _message_dict(
        self, message: Message, texts: list[str], media: dict[Modality, list[MediaPart]]
    ) -> dict[str, Any]:
        parts: list[dict[str, str]] = []
        role = self._escape(message.role, texts)
        for part in message.content:
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": self._escape(part.text, texts)})
            elif isinstance(part, ImagePart | VideoPart):
                parts.append({"type": str(part.modality)})
                media[part.modality].append(part)
            else:
                raise ValueError(f"unsupported content part {part!r}")
        return message_dict(role, parts)

    def _pieces(
        self, rendered: str, texts: list[str], media: dict[Modality, list[MediaPart]]
    ) -> list[Piece]:
        pieces: list[Piece] = []
        text: list[str] = []  # text since the last other piece, joined once (+= was quadratic)
        used = dict.fromkeys(media, 0)

        def flush() -> None:
            joined = "".join(text)
            if joined:
                pieces.append(joined)
            text.clear()

        def emit(piece: Piece) -> None:
            if isinstance(piece, str):
                text.append(piece)
            else:
                flush()
                pieces.append(piece)

        for k, chunk in enumerate(self._splitter.split(rendered)):
            if k % 2 == 0:
                emit(chunk)
            elif chunk in _MEDIA:
                kind = _MEDIA[chunk]
                if used[kind] >= len(media[kind]):
                    raise ValueError(f"chat template places more {kind}s than given")
                emit(media[kind][used[kind]])
                used[kind] += 1
            elif chunk.startswith(_MARK_OPEN):
                emit(texts[int(chunk[1:-1])])
            elif chunk in _BARE_PADS:
                raise ValueError(f"chat template places {chunk} outside <|vision_start|>..end")
            else:
                emit(Control(chunk))
        flush()
        for kind, parts in media.items():
            if used[kind] != len(parts):
                raise ValueError(f"chat template placed {used[kind]} of {len(parts)} {kind}s")
        return pieces


def load_chat_template(folder: str | Path, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The checkpoint's chat template compiled for `tokenizer` and checked (`check`), or
    None when it has none. Raises `CheckpointError` naming the file that holds it.

    Template variables `bos_token`, `eos_token`, `pad_token`, `unk_token` come from
    `tokenizer_config.json` when it names them as strings.
    """
    folder = Path(folder)
    found = _find_template(folder)
    if found is None:
        return None
    source, origin = found
    variables: dict[str, str] = {}
    raw = read_checkpoint_object(folder / "tokenizer_config.json")
    if raw is not None:
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = raw.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                variables[key] = value
    added = list(tokenizer.get_added_tokens_decoder().values())
    template = ChatTemplate(
        source,
        added_tokens=[t.content for t in added],
        special_tokens=[t.content for t in added if t.special],
        variables=variables,
        origin=origin,
    )
    template.check()
    return template


# Groups nested deeper than this are matched flat: the regex compiler takes ~3 frames of
# Python's stack a group (RecursionError near 300 groups from a shallow caller, at 200 from
# one 400 frames deep; s35diff review), and `longest_of`'s own recursion one. Real tokens
# nest a few deep.
MAX_NESTING = 100


def message_dict(role: str, parts: list[dict[str, str]]) -> dict[str, Any]:
    """A message as templates are given it: one text part as a string, else its parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return {"role": role, "content": parts[0]["text"]}
    return {"role": role, "content": parts}


def longest_of(strings: Iterable[str]) -> str:
    """A regex matching the longest of `strings` that starts where it is tried, as their
    alternation longest first does, but as a tree of their common prefixes: tried at every
    character of a user's text, the flat alternation compared each of a checkpoint's dozens
    of special tokens in turn, GIL held (1 MiB of "<" took 0.7 s; stalls review)."""
    unique = {s for s in strings if s}
    tree: dict[str, Any] = {}
    for string in unique:
        node = tree
        for char in string:
            node = node.setdefault(char, {})
        node[""] = {}  # a string ends here

    def pattern(node: dict[str, Any]) -> str:
        longer = [re.escape(c) + chain(child) for c, child in sorted(node.items()) if c]
        if not longer:
            return ""
        group = "(?:" + "|".join(longer) + ")"
        return group + "?" if "" in node else group  # longer first, then ending here

    def chain(node: dict[str, Any]) -> str:
        # A run of nodes with one way on is one literal, not a group each: nested groups as
        # deep as a token is long hit the regex compiler's and Python's recursion limits
        # (a 500-character added token stopped a checkpoint loading; s34diff review).
        literal = ""
        while len(node) == 1 and "" not in node:
            ((char, node),) = node.items()
            literal += re.escape(char)
        return literal + pattern(node)

    def depth(node: dict[str, Any]) -> int:  # groups `pattern` nests along its deepest path
        most, todo = 0, [(node, 0)]
        while todo:
            node, deep = todo.pop()
            while len(node) == 1 and "" not in node:
                node = next(iter(node.values()))
            if node:
                most = max(most, deep + 1)
                todo.extend((child, deep + 1) for c, child in node.items() if c)
        return most

    if depth(tree) > MAX_NESTING:  # a checkpoint's odd tokens: the flat alternation, as slow
        return "|".join(re.escape(s) for s in sorted(unique, key=len, reverse=True))
    return pattern(tree) or "(?!)"  # none: a regex that matches nothing
