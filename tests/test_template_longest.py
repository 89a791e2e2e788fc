"""`common.processing.template.longest_of`: the special tokens a chat template hides in user
text and splits its output at, as a tree of their prefixes. It must match exactly what
their alternation, longest first, matches (the flat one held the GIL 0.7 s over 1 MiB of
"<" with a real checkpoint's tokens; stalls review)."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from common.processing.template import MAX_NESTING, longest_of

ALPHABET = "<|>ab\\.*"  # regex metacharacters among them


def flat(strings: set[str]) -> str:
    return "|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True) if s)


@given(st.sets(st.text(ALPHABET, max_size=5), max_size=12), st.text(ALPHABET, max_size=60))
@settings(max_examples=500, deadline=None)
def test_it_matches_what_the_longest_first_alternation_matches(strings, text) -> None:
    if not any(strings):
        assert re.findall(longest_of(strings), text) == []
        return
    ours, theirs = re.compile(longest_of(strings)), re.compile(flat(strings))
    assert [m.span() for m in ours.finditer(text)] == [m.span() for m in theirs.finditer(text)]
    assert ours.split(text) == theirs.split(text)


def test_qwen_tokens_split_the_same() -> None:
    tokens = {"<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<think>"}
    tokens |= {"</think>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>"}
    text = "a<|im_start|>b<|im_end|><<|<think></think><|image_pad|><|vision_start|>" * 3
    assert re.split(f"({longest_of(tokens)})", text) == re.split(f"({flat(tokens)})", text)


def test_a_long_token_is_one_literal_not_a_group_a_character() -> None:
    # A group a character nested as deep as the token is long: a 500-character added token
    # raised RecursionError as its checkpoint loaded (s34diff review).
    tokens = {"<" + "x" * 5000 + ">", "<y>", "<" + "x" * 4000 + "z>"}
    text = "a" + "<" + "x" * 5000 + ">" + "<y><" + "x" * 4000 + "z>" + "<" + "x" * 4999
    assert re.split(f"({longest_of(tokens)})", text) == re.split(f"({flat(tokens)})", text)


def test_tokens_nested_past_what_the_regex_compiler_takes_are_matched_flat() -> None:
    # 600 tokens each a prefix of the next nest a group each: re.compile raised
    # RecursionError (ownfix review); past a depth the flat alternation is used.
    for tokens in ({"x" * i for i in range(1, 601)}, {"<" + "x" * i + "a" for i in range(600)}):
        text = "y" + "x" * 700 + "<" + "x" * 300 + "a<xa"
        assert re.split(f"({longest_of(tokens)})", text) == re.split(f"({flat(tokens)})", text)


def test_tokens_nested_as_deep_as_taken_compile_from_a_deep_caller() -> None:
    # At 200 groups, the regex compiler's own recursion ran out 400 frames deep (s35diff).
    tokens = {"x" * i for i in range(1, MAX_NESTING + 1)}

    def deep(frames: int) -> re.Pattern[str]:
        return deep(frames - 1) if frames else re.compile(longest_of(tokens))

    matched = deep(400).match("x" * (MAX_NESTING + 5))
    assert matched is not None and matched[0] == "x" * MAX_NESTING
