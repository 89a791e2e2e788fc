"""What a chat sends the chat template that this server does not pass to it: vLLM's
`chat_template_kwargs` keys, its `documents`, an answer's `reasoning_content` or
`reasoning`. Each is refused, naming it, where the checkpoint's template would use it (the
prompt would change unsaid); where it cannot change the prompt it is ignored:
`{"enable_thinking": false}`, which clients set up for Qwen3 send, to a template without
it (refusing every one was a 400 for them: ownfixA review, s44), or the reasoning of an
earlier answer a Qwen3-style template leaves out (a client appending each answer to its
history: ownfixA F1, s45). `documents` and reasoning were dropped unsaid (s44diff review
L1, L2, s45)."""

from __future__ import annotations

from typing import Any

from common.errors import FieldError
from common.processing.template import ChatTemplate, message_dict
from router.http.schema import ChatCompletionRequest, ChatMessage, TextContent

SAID = "the chat template reads it; passing it to the template is not supported by this server"
REASONING = ("reasoning_content", "reasoning")


def check_template_inputs(body: ChatCompletionRequest, template: ChatTemplate | None) -> None:
    """FieldError naming a `chat_template_kwargs` key or `documents` the template reads
    (`ChatTemplate.reads`, the variables it reads). None: the built-in layout, which reads
    none. An answer's reasoning: `check_reasoning`."""
    reads = frozenset() if template is None else template.reads
    for key in body.chat_template_kwargs or {}:
        if key in reads:
            raise FieldError(f"chat_template_kwargs.{key}", SAID)
    if body.documents and "documents" in reads:
        raise FieldError("documents", SAID)


def reasoning_to_check(body: ChatCompletionRequest) -> bool:
    """Whether `check_reasoning` has to render: an answer holds reasoning (vLLM passes an
    assistant message's only; another's is ignored, here too: ownfixC L4, s45)."""
    return any(getattr(m, f) for m in body.messages if m.role == "assistant" for f in REASONING)


def check_reasoning(body: ChatCompletionRequest, template: ChatTemplate) -> None:
    """FieldError naming a message's `reasoning_content` or `reasoning` where the template
    renders the chat otherwise with them (given under both names, as vLLM's versions pass
    them) than without: two renders, whatever the chat's length (the last message holding
    reasoning is named). A chat the template fails to render without them is left to the
    processor, which says so."""
    plain = [_as_template_sees(m) for m in body.messages]
    given = [dict(d) for d in plain]
    last = None
    for m, message in enumerate(body.messages):
        for field in REASONING if message.role == "assistant" else ():
            if value := getattr(message, field):
                given[m].update(reasoning_content=value, reasoning=value)
                last = f"messages[{m}].{field}"
    if last is None:
        return
    try:
        without = template.render_text(plain, True, None)
    except ValueError:
        return
    try:
        differs = template.render_text(given, True, None) != without
    except ValueError:
        differs = True
    if differs:
        raise FieldError(last, SAID)


def _as_template_sees(message: ChatMessage) -> dict[str, Any]:
    """The message as the processor gives it to the template (`ChatTemplate.render`, its
    texts unescaped): media as their type."""
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if isinstance(content, str):
        return message_dict(role, [{"type": "text", "text": content}])
    return message_dict(
        role,
        [
            {"type": "text", "text": part.text}
            if isinstance(part, TextContent)
            else {"type": "image" if part.type == "image_url" else "video"}
            for part in content
        ],
    )
