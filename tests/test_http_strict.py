"""The HTTP API reads a request as JSON and HTTP have it, and refuses what is ambiguous
(a review against OpenAI's API, s29): a key named twice, a header sent twice, a boolean
for a count, a compressed body or a charset `json.loads` cannot read, an OpenAI field that
asks for what is not done. Each was accepted and served as one reading of it.

The body's parsing without a server (`router.http.parse.parse_body`, then the conversion);
the head's checks are in tests/test_http_head.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import pytest

from common.errors import FieldError
from router.http.convert import chat_request, completion_request
from router.http.errors import ApiError, model_not_found
from router.http.media import MediaPolicy
from router.http.parse import MAX_BODY_STRINGS, parse_body
from router.http.schema import ACCEPTED_AND_IGNORED, ChatCompletionRequest, CompletionRequest
from tests.test_http_api import MODEL_ID, png_data_url

HI = '[{"role": "user", "content": "hi"}]'


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **extra}


def refused(data: bytes | str, content_type: str | None = "application/json") -> ApiError:
    """What `parse_body` answers a chat body it refuses."""
    raw = data.encode() if isinstance(data, str) else data
    with pytest.raises(ApiError) as err:
        parse_body(raw, content_type, ChatCompletionRequest)
    return err.value


# ------------------------------------------------------------------------- the body's JSON


@pytest.mark.parametrize(
    ("data", "param"),
    [
        (f'{{"model": "nope", "model": "{MODEL_ID}", "messages": {HI}}}', "model"),
        (f'{{"model": "{MODEL_ID}", "messages": {HI}, "messages": {HI}}}', "messages"),
        (f'{{"model": "{MODEL_ID}", "messages": {HI}, "stream": false, "stream": true}}', "stream"),
        (
            f'{{"model": "{MODEL_ID}", "messages": [{{"role": "user", "content": [{{"type": '
            '"image_url", "type": "text", "text": "x"}]}]}',
            "messages[0].content[0].type",
        ),
        (
            f'{{"model": "{MODEL_ID}", "messages": [{HI[1:-1]}, {{"role": "user", "role": '
            '"system", "content": "x"}]}',
            "messages[1].role",
        ),
    ],
)
def test_a_key_named_twice_is_refused_by_its_path(data: str, param: str) -> None:
    # The last one was served: a proxy in front that reads the first checked another
    # model, prompt or stream than the router served.
    error = refused(data)
    assert (error.status, error.param) == (400, param), str(error)
    assert str(error) == f"the body names {param!r} twice"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant: str) -> None:
    # `"fps": NaN` was refused as "less than or equal to 10000".
    # It also said where, as every other syntax error does (the fuzz review): the first
    # token outside a string, not the same text inside one, nor in a key.
    body = f'{{"model": "{MODEL_ID}", "{constant}": "{constant}", "temperature": {constant}}}'
    error = refused(body)
    assert (error.status, error.param) == (400, None)
    at = body.rindex(constant)
    assert (
        str(error)
        == f"the body is not valid JSON: {constant} is not a JSON value (at character {at})"
    )


def test_a_constants_place_is_found_past_escaped_quotes_and_backslashes() -> None:
    # Found by a scan that skips strings as `json` reads them: a regex over them kept state
    # per escape, and a body of escapes held the router's loop 35 s (ownfixD review).
    body = r'{"model": "m", "a\"NaN": "\\", "b": "x\"NaN\\", "c": "' + "\\n" * 5000
    body += r'", "temperature": NaN}'
    error = refused(body)
    assert str(error).endswith(f"NaN is not a JSON value (at character {body.rindex('NaN')})")


def test_long_numbers_and_objects_of_many_keys_are_refused_before_they_hold_the_loop() -> None:
    # `json.loads` converts digits and reads an object's keys in C, GIL held, whatever
    # thread runs it: 250 MiB of 4299-digit integers in an ignored field stalled the router
    # 8.5 s and was answered 200; one object of 2M keys held it 1.7-2.5 s (stalls review).
    for number in ("1" * 65, "0." + "1" * 63, "1e" + "0" * 63):
        body = f'{{"model": "{MODEL_ID}", "messages": {HI}, "junk": ["{number}", {number}]}}'
        error = refused(body)
        at = f"(at character {body.rindex(number)})"
        assert f"a number of more than 64 characters {at}" in str(error), str(error)
    keys = ", ".join(f'"{i}": 1' for i in range(MAX_BODY_STRINGS + 1))
    started = time.process_time()
    error = refused(f'{{"model": "{MODEL_ID}", "messages": {HI}, "junk": {{{keys}}}}}')
    assert f"more than {MAX_BODY_STRINGS} strings" in str(error)
    assert time.process_time() - started < 0.1  # counted, not parsed
    slashed = json.dumps({f"{i}\\": None for i in range(MAX_BODY_STRINGS)})  # keys end in `\\"`
    error = refused(f'{{"model": "{MODEL_ID}", "messages": {HI}, "junk": {slashed}}}')
    assert f"more than {MAX_BODY_STRINGS} strings" in str(error)  # each counted, not undone
    quoted = json.dumps(chat(messages=[{"role": "user", "content": '"' * 600_000}]))
    assert parse_body(quoted.encode(), None, ChatCompletionRequest)  # escaped: text, not keys


def test_a_charset_json_cannot_read_is_refused_saying_send_utf8() -> None:
    body = json.dumps(chat(messages=[{"role": "user", "content": "café"}]), ensure_ascii=False)
    latin = body.encode("latin-1")
    error = refused(latin, "application/json; charset=iso-8859-1")
    assert error.status == 415 and str(error) == (
        "charset iso-8859-1 is not supported: send the body as UTF-8"
    )
    assert refused(body.encode(), "application/json; charset=no-such-charset").status == 415
    # Undeclared, it was refused naming the 'utf-8' codec only.
    error = refused(latin, "application/json")
    assert error.status == 400 and str(error).endswith("send it as UTF-8"), str(error)
    for charset in ("utf-8", "UTF8", "us-ascii", "utf-16"):
        data = body.encode("utf-16" if charset == "utf-16" else "utf-8")
        parsed = parse_body(data, f"application/json; charset={charset}", ChatCompletionRequest)
        assert parsed.messages[0].content == "café"


# -------------------------------------------------------------------------- strict types


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": True}, "max_tokens"),  # was 1 token, finish_reason length
        ({"max_tokens": "3"}, "max_tokens"),
        ({"max_tokens": 3.5}, "max_tokens"),
        ({"max_completion_tokens": False}, "max_completion_tokens"),
        ({"seed": "5"}, "seed"),
        ({"top_k": "3"}, "top_k"),
        ({"n": True}, "n"),
        ({"stream": "yes"}, "stream"),  # was a stream
        ({"stream": 1}, "stream"),
        ({"ignore_eos": "on"}, "ignore_eos"),
        ({"temperature": True}, "temperature"),  # was 1.0
        ({"temperature": "0"}, "temperature"),
        ({"logprobs": "1"}, "logprobs"),  # a union's labels are not in the param
        ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
        ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options"),
    ],
)
def test_booleans_and_integers_are_not_read_from_strings_or_each_other(
    extra: dict[str, Any], param: str
) -> None:
    error = refused(json.dumps(chat(**extra)))
    assert error.status == 400 and error.param is not None, str(error)
    assert error.param.startswith(param) and str(error).startswith(f"{error.param}: "), str(error)


def test_json_numbers_still_fit_number_fields() -> None:
    # A float field takes a JSON integer; an integer field a whole number written as a
    # float (Python clients send a computed count as 3.0), as pydantic's lax mode did.
    extra = {"temperature": 1, "top_p": 1, "max_tokens": 3.0, "seed": 7.0, "logprobs": False}
    body = parse_body(json.dumps(chat(**extra)).encode(), None, ChatCompletionRequest)
    assert (body.temperature, body.top_p, body.max_tokens, body.seed) == (1.0, 1.0, 3, 7)
    assert type(body.max_tokens) is int and type(body.seed) is int
    assert chat_request(body, "r", MediaPolicy()).sampling.max_tokens == 3


# --------------------------------------------------------------- fields asked for, not done


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"web_search_options": {}}, "web_search_options"),  # `{}` asks for a search
        ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
        ({"moderation": {"input": {"policy": "default"}}}, "moderation"),
        ({"store": True}, "store"),
        ({"response_format": {}}, "response_format"),  # was read as text
        ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format"),
        ({"max_tokens": 3, "max_completion_tokens": 5}, "max_completion_tokens"),
        # vLLM's chat takes these too (echo: the last message said again); they were dropped
        # as unknown fields, a 200 without them (docswalk review, s33).
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"n": 2}, "n"),  # refused saying why, not with pydantic's bound (openai F6, s44)
        # vLLM's, each a 200 as if not asked (sampling and openai reviews, s44).
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"typical_p": 0.5}, "typical_p"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"logits_processors": ["x"]}, "logits_processors"),
        ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
        ({"chat_template": "{{ 'x' }}"}, "chat_template"),
        ({"mm_processor_kwargs": {"fps": 1}}, "mm_processor_kwargs"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),  # s44diff M1, s45
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "assistant", "content": "", "refusal": "no"}]},
            "messages[0].refusal",
        ),
    ],
)
def test_what_is_asked_for_and_not_done_is_refused(extra: dict[str, Any], param: str) -> None:
    body = parse_body(json.dumps(chat(**extra)).encode(), None, ChatCompletionRequest)
    with pytest.raises(FieldError) as err:
        chat_request(body, "r", MediaPolicy())
    assert err.value.field == param
    if param == "n":
        assert "only 1 is supported" in str(err.value)
    if "max_tokens" in extra:  # both named
        assert "max_tokens is 3" in str(err.value) and "is 5" in str(err.value)


def test_neutral_values_and_the_ignored_fields_are_accepted() -> None:
    ignored = {k: "x" for k in ACCEPTED_AND_IGNORED if k.isidentifier()}
    assert {"metadata", "service_tier", "reasoning_effort", "parallel_tool_calls"} <= set(ignored)
    image = {"type": "image_url", "image_url": {"url": png_data_url(1), "detail": "low"}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": [image], "name": "ann"}]
    extra: dict[str, Any] = {"store": False, "web_search_options": None, "moderation": None}
    extra |= {"echo": False, "best_of": 1}
    extra |= ignored
    extra |= {"response_format": {"type": "text"}, "max_tokens": 4, "max_completion_tokens": 4}
    extra |= {"typical_p": 1, "skip_special_tokens": True, "add_special_tokens": False}
    extra |= {"chat_template_kwargs": {}, "mm_processor_kwargs": {}, "allowed_token_ids": None}
    extra |= {"logits_processors": [], "vllm_xargs": {}}  # `[]` was refused (s44diff, s45)
    # An answer's message as OpenAI returns it, sent back in the history.
    said: dict[str, Any] = {"role": "assistant", "content": "ok", "refusal": None}
    messages = [*messages, said | {"tool_calls": [], "audio": None, "function_call": None}]
    body = parse_body(
        json.dumps(chat(messages=messages, **extra)).encode(), None, ChatCompletionRequest
    )
    assert chat_request(body, "r", MediaPolicy()).sampling.max_tokens == 4
    prompt = CompletionRequest.model_validate({"model": MODEL_ID, "prompt": "x", "store": True})
    assert completion_request(prompt, "r").prompt == "x"  # a chat's field only


def test_a_template_input_is_refused_only_where_the_template_uses_it() -> None:
    # Refused whole, `{"enable_thinking": false}` (which clients set up for Qwen3 send) was
    # a 400 against templates that never read it (ownfixA review, s44); one the template
    # reads would change the prompt unsaid, as vLLM's `documents` did, dropped (s44diff
    # review L1, s45).
    from common.processing.template import ChatTemplate
    from router.http.template_inputs import check_template_inputs

    source = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
        "{% for d in documents or [] %}{{ d }}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.reads == {"messages", "enable_thinking", "documents"}
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs."),
        ({"documents": [{"text": "d"}]}, "documents"),
    ]
    for extra, field in cases:
        body = parse_body(json.dumps(chat(**extra)).encode(), None, ChatCompletionRequest)
        with pytest.raises(FieldError) as err:
            check_template_inputs(body, template)
        assert err.value.field.startswith(field), err.value.field
        check_template_inputs(body, plain)  # not read: ignored
        check_template_inputs(body, None)  # the built-in layout reads none
        chat_request(body, "r", MediaPolicy())  # nothing else refuses it
    body = parse_body(json.dumps(chat(documents=[])).encode(), None, ChatCompletionRequest)
    check_template_inputs(body, template)


# As Qwen3's templates do: an answer's reasoning is rendered only after the last user turn.
QWEN3_LIKE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor -%}"
    "{%- for m in messages -%}{{ m.role }}:"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last and m.reasoning_content -%}"
    "<think>{{ m.reasoning_content }}</think>{%- endif -%}{{ m.content }}|"
    "{%- endfor -%}"
)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_answers_reasoning_is_refused_only_where_the_template_renders_it(field: str) -> None:
    # Dropped unsaid where the template renders it (s44diff review L2, s45); refused where
    # the template names the field, a client appending each answer (its reasoning too) to
    # its history got a 400 from a Qwen3-style template that leaves it out (ownfixA F1);
    # refused after the last user message, reasoning a template renders before it passed
    # (ownfixB F1): the template's own render says.
    from common.processing.template import ChatTemplate
    from router.http.template_inputs import check_reasoning, reasoning_to_check

    template = ChatTemplate(QWEN3_LIKE)
    answer = {"role": "assistant", "content": "ok", field: "because"}
    question = {"role": "user", "content": "and?"}

    def body(*messages: dict[str, Any]) -> ChatCompletionRequest:
        raw = json.dumps(chat(messages=list(messages))).encode()
        return parse_body(raw, None, ChatCompletionRequest)

    last = body(question, answer)  # rendered: the answer comes after the last question
    assert reasoning_to_check(last)
    with pytest.raises(FieldError) as err:
        check_reasoning(last, template)
    assert err.value.field == f"messages[1].{field}"
    check_reasoning(body(question, answer, question), template)  # left out: ignored
    check_reasoning(body(question, answer | {field: ""}), template)  # empty: neutral
    said = {"role": "system", "content": "be brief", field: "x"}  # not an answer's: ignored
    check_reasoning(body(question, said), ChatTemplate("{{ messages|tojson }}"))
    every = ChatTemplate(
        "{% for m in messages %}{{ m.reasoning_content }}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(FieldError):  # one that renders every answer's: refused there too
        check_reasoning(body(question, answer, question), every)
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    check_reasoning(last, plain)  # not read: ignored
    whole = ChatTemplate("{% for m in messages %}{{ m|tojson }}{% endfor %}")
    with pytest.raises(FieldError):  # read with the message whole
        check_reasoning(last, whole)


def test_a_completions_response_format_other_than_text_is_refused() -> None:
    # It was a chat's field only: a completion asking for JSON got text (openai s44 F1).
    body = {"model": MODEL_ID, "prompt": "x", "response_format": {"type": "json_object"}}
    with pytest.raises(FieldError) as err:
        completion_request(CompletionRequest.model_validate(body), "r")
    assert err.value.field == "response_format"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([], "messages[0].content"),  # OpenAI refuses an empty array; it was an empty turn
        (
            [{"type": "image_url", "image_url": {"url": "data:,", "detail": "bogus"}}],
            "messages[0].content[0].image_url.detail",
        ),
    ],
)
def test_an_empty_content_or_an_unknown_detail_is_refused(content: Any, param: str) -> None:
    error = refused(json.dumps(chat(messages=[{"role": "user", "content": content}])))
    assert (error.status, error.param) == (400, param), str(error)


def test_an_internal_error_is_openais_server_error() -> None:
    error = ApiError(grpc.StatusCode.INTERNAL, "internal error")
    assert (error.status, error.body()["error"]["type"]) == (500, "server_error")


def test_chunks_carry_the_null_fields_openai_documents() -> None:
    # With include_usage every chunk before the usage one says "usage": null, and every
    # choice "logprobs": null (completions' had no such key, streamed chats' neither).
    from router.http.stream import Answer

    for chat_api in (True, False):
        answer = Answer("id-1", "tiny", chat_api)
        with_usage = answer.delta("hi", None, True, usage=True)
        assert with_usage["usage"] is None and with_usage["choices"][0]["logprobs"] is None
        assert "usage" not in answer.delta("hi", None, False)
        assert answer.final()["choices"][0]["logprobs"] is None


def test_what_a_caller_sent_is_repeated_escaped_and_cut() -> None:
    # An unknown part type was repeated whole and unescaped: a "\n" in it wrote forged
    # lines into the router's log, and a 16 MiB one grew the log (and the answer) by 16 MiB
    # (security review, s32). The same for a model name the server does not serve.
    forged = "x\n2026-12-06 16:00:00,000 INFO router.server: FORGED" + "y" * 100_000
    part = {"type": forged, "text": "hi"}
    error = refused(json.dumps(chat(messages=[{"role": "user", "content": [part]}])))
    message = str(error.body()["error"]["message"])
    assert error.body()["error"]["param"] == "messages[0].content[0]"
    assert "\n" not in message and "FORGED" in message and len(message) < 1000
    assert f"{len(forged)} characters" in message and "expected" in message
    wrong = model_not_found("m\n" + "z" * 100_000, MODEL_ID, param="model")
    shown = str(wrong.body()["error"]["message"])
    assert "\n" not in shown and len(shown) < 1000 and "100002 characters" in shown


def test_text_in_other_scripts_is_repeated_as_it_is() -> None:
    # Escaping a whole message for one line break made CJK text unreadable (own-fix review).
    from router.ids import loggable, shown_text

    assert loggable("字段 名字\n无效\u202e", 100) == "字段 名字\\n无效\\u202e"
    assert shown_text("模型\n") == "'模型\\n'"
    wrong = model_not_found("模型", MODEL_ID)
    assert "'模型'" in str(wrong.body()["error"]["message"])
