"""A checkpoint's chat template is checked once at load: a template that fails every chat (an
exception, a sandbox escape, a render past its repeat, integer, loop or time bounds, one that
does not compile) is refused with a `CheckpointError` naming its file (and key); one that
cannot render an image loads with a warning; rendering is bounded by its thread's CPU time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from common.errors import CheckpointError
from common.processing.processor import Processor
from common.processing.template import ChatTemplate

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'text' %}{{ p.text }}{% else %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BAD_TEMPLATES = [
    ("{{ raise_exception('never') }}", "fails on a short test chat: .*never"),
    ("{{ messages.nope.deeper }}", "fails on a short test chat"),
    ("{{ messages|attr('__class__') }}", "without its user text"),
    ("{{ '{0.__class__}'.format(messages) }}", "without its user text"),
    ("{{ 'x' * 3000000000 }}" + _CHATML, "repeats past"),
    ("{{ 2 ** 10000000 }}" + _CHATML, "integer past"),
    (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "loops exceed",
    ),
    ("{% if %}", "does not compile"),
]


@pytest.mark.parametrize(("source", "message"), BAD_TEMPLATES)
def test_a_template_that_fails_every_chat_is_refused_at_load(
    ckpt_copy: Path, source: str, message: str
) -> None:
    (ckpt_copy / "chat_template.jinja").write_text(source)
    with pytest.raises(CheckpointError, match=rf"chat_template\.jinja: .*{message}"):
        Processor.from_pretrained(ckpt_copy)


def test_a_template_found_in_a_json_file_is_named_with_its_key(ckpt_copy: Path) -> None:
    (ckpt_copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat_template: does"):
        Processor.from_pretrained(ckpt_copy)


def test_a_render_the_sandbox_cannot_stop_fails_the_check_in_time() -> None:
    # No call, lookup or range inside the loops: only the check's timeout stops it.
    source = "{% set s = 'x' * 3000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
    with pytest.raises(CheckpointError, match=r"took more than 0\.05 s"):
        ChatTemplate(source, origin="chat_template.jinja").check(timeout_s=0.05)


def test_a_text_only_template_loads_with_a_warning(
    ckpt_copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (ckpt_copy / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    caplog.set_level(logging.WARNING)
    Processor.from_pretrained(ckpt_copy).process([{"role": "user", "content": "hi"}])
    assert any("fails on a chat with an image" in r.getMessage() for r in caplog.records)


def test_a_memory_error_while_rendering_is_a_value_error(
    ckpt_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ckpt_copy / "chat_template.jinja").write_text(_CHATML)
    processor = Processor.from_pretrained(ckpt_copy)
    assert processor.template is not None

    def out_of_memory(*args: Any, **kwargs: Any) -> str:
        raise MemoryError

    monkeypatch.setattr(processor.template._template, "render", out_of_memory)
    with pytest.raises(ValueError, match="chat template: MemoryError"):
        processor.process([{"role": "user", "content": "hi"}])


def test_a_renders_time_is_the_cpu_time_of_its_thread() -> None:
    # On wall-clock time, 16 legitimate 0.7 s renders at once (one GIL) were refused as out
    # of time, as the caller's invalid input. Waiting (here, sleeping) spends none of it;
    # the budget made in one thread counts the thread that renders.
    import threading
    import time

    from jinja2.exceptions import SecurityError

    from common.processing.template_sandbox import new_budget

    limits = new_budget(0.05)
    outcome: list[BaseException | None] = []

    def render() -> None:
        try:
            for _ in range(3):
                limits.step()
                time.sleep(0.05)  # 0.15 s of wall time, about none of CPU
            outcome.append(None)
            end = time.thread_time() + 0.2
            while time.thread_time() < end:
                pass
            limits.step()
        except SecurityError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=render)
    thread.start()
    thread.join()
    assert outcome[0] is None and isinstance(outcome[1], SecurityError)


async def test_a_chat_setting_a_variable_its_template_reads_is_refused_naming_it(
    ckpt_copy: Path,
) -> None:
    # Over HTTP: one the template reads would change the prompt unsaid; one it does not
    # read cannot, and is ignored (all of them were refused: ownfixA review, s44).
    import asyncio

    from tests.cluster import CLIENT_KEY
    from tests.test_http_api import MODEL_ID, WEATHER, add_workers, call, fake_router, url_of

    thinking = "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    (ckpt_copy / "chat_template.jinja").write_text(_CHATML + thinking)
    c = await fake_router(ckpt_copy)
    try:
        await add_workers(c)
        url = f"{url_of(c)}/v1/chat/completions"
        for kwargs, status in (({"enable_thinking": False}, 400), ({"other": 1}, 200)):
            body = {"model": MODEL_ID, "messages": WEATHER, "max_tokens": 2}
            body["chat_template_kwargs"] = kwargs
            got, _, reply = await asyncio.to_thread(call, url, body, CLIENT_KEY)
            assert got == status, reply
            if got == 400:
                assert reply["error"]["param"] == "chat_template_kwargs.enable_thinking"
        assert reply["choices"][0]["finish_reason"] == "length"
    finally:
        await c.close()
