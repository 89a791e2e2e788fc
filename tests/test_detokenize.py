"""The router's incremental detokenizer (`router.detokenize`) with a byte-level decode (one
token a byte, so tokens end inside characters): the text out is the same however the tokens
are grouped into calls (a decode worker's `stream_interval` sends several a chunk), and a
stream resumed on another router (`skip`) goes on exactly where the first one stopped."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from router.detokenize import REPLACEMENT, IncrementalDetokenizer

ANSWER = "xa é 猫 b🙂c"
IDS = list(ANSWER.encode())


def decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def chunked(ids: list[int], size: int) -> list[list[int]]:
    """The first token alone (the prefill worker's), then chunks of `size` (the decode's)."""
    return [ids[:1]] + [ids[k : k + size] for k in range(1, len(ids), size)]


def one_by_one(ids: list[int]) -> list[str]:
    """The text out after each token, added one at a time."""
    detok = IncrementalDetokenizer(decode)
    out = [""]
    for token_id in ids:
        out.append(out[-1] + detok.add([token_id]))
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_the_text_out_does_not_depend_on_how_tokens_are_grouped(size: int) -> None:
    """After each chunk the text out is what one token a call would have given after the
    same tokens: every complete character, also those before a token that ends inside one."""
    want = one_by_one(IDS)
    detok = IncrementalDetokenizer(decode)
    text, seen = "", 0
    for chunk in chunked(IDS, size):
        text += detok.add(chunk)
        seen += len(chunk)
        assert text == want[seen], (size, seen)
    assert text + detok.flush() == ANSWER


def test_a_chunk_ending_inside_a_character_gives_the_characters_before_it() -> None:
    detok = IncrementalDetokenizer(decode)
    assert detok.add([ord("x"), ord("a"), 0xC3]) == "xa"  # "é" is C3 A9
    assert detok.add([0xA9, ord("b")]) == "éb"
    assert detok.flush() == ""


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_a_stream_resumed_after_any_chunk_goes_on_where_the_first_router_stopped(
    size: int,
) -> None:
    """The first router sends the chunks up to some point and dies; the client resumes on
    another, which `skip`s the tokens the client has and sends the rest: the client ends
    with the whole answer, no character lost or sent twice."""
    chunks = chunked(IDS, size)
    for cut in range(1, len(chunks)):
        first = IncrementalDetokenizer(decode)
        had = "".join(first.add(chunk) for chunk in chunks[:cut])
        resumed = [t for chunk in chunks[:cut] for t in chunk]
        second = IncrementalDetokenizer(decode)
        second.skip(resumed)
        rest = "".join(second.add(chunk) for chunk in chunked(IDS[len(resumed) :], size))
        assert had + rest + second.flush() == ANSWER, (size, cut, had, rest)


class Counting:
    """`decode`, counting the tokens it is given (the detokenizer's work)."""

    def __init__(self) -> None:
        self.tokens = 0

    def __call__(self, ids: Sequence[int]) -> str:
        self.tokens += len(ids)
        return decode_eos(ids)


EOS = 256  # a special token: no text


def decode_eos(ids: Sequence[int]) -> str:
    return decode([i for i in ids if i != EOS])


@pytest.mark.parametrize("run", [[EOS], [0x80], [0xFF, 0x80, 0xC3]])
def test_a_long_run_of_tokens_without_a_whole_character_costs_linear_work(run: list[int]) -> None:
    # Special tokens (EOS with ignore_eos) add no text and invalid bytes end in U+FFFD, and
    # the window decoded again grew with each: 20,000 such tokens took 10 to 18 s of the
    # router's event loop, every other request waiting.
    ids = [ord("a"), *run * 5000, *"é b".encode()]
    counting = Counting()
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == decode_eos(ids)
    assert counting.tokens < 100 * len(ids)


def test_the_tokens_bytes_of_a_byte_level_tokenizer_decode_as_decode_does() -> None:
    # What the router's detokenizer reads instead of decoding windows of tokens again.
    import random

    from common.models.tiny import default_checkpoint
    from common.processing.processor import Processor

    processor = Processor.from_pretrained(default_checkpoint("tiny"))
    table = processor.token_bytes
    assert table is not None and len(table) == processor.tokenizer.get_vocab_size()
    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(len(table)) for _ in range(rng.randrange(1, 12))]
        detok = IncrementalDetokenizer(processor.decode, table)
        streamed = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert streamed == processor.decode(ids), ids


# Tokens that each end one character and begin the next (BPE merges bytes across characters):
# no token boundary is a character boundary, so a window never came clean.
CHAIN = "一二三四五六七八九十" * 3
CHAIN_BYTES = CHAIN.encode()
# One byte, then three at a time: every boundary falls one byte into a character.
CHAIN_TABLE = [CHAIN_BYTES[:1]] + [CHAIN_BYTES[k : k + 3] for k in range(1, len(CHAIN_BYTES), 3)]


def test_with_the_tokens_bytes_text_is_exact_whatever_the_tokens_split() -> None:
    ids = list(range(len(CHAIN_TABLE)))

    def decode(tokens: Sequence[int]) -> str:
        return b"".join(CHAIN_TABLE[t] for t in tokens).decode("utf-8", "replace")

    for size in (1, 2, 5):
        detok = IncrementalDetokenizer(decode, CHAIN_TABLE)
        out = [detok.add(chunk) for chunk in chunked(ids, size)]
        assert "".join(out) + detok.flush() == CHAIN
        assert all(REPLACEMENT not in piece for piece in out)  # never a character cut
    counting = Counting()
    detok = IncrementalDetokenizer(counting, [bytes([b]) for b in range(256)] + [b""])
    text = "".join(detok.add([i]) for i in [ord("a"), *[0x80, EOS] * 5000]) + detok.flush()
    assert text == decode_eos([ord("a"), *[0x80] * 5000]) and counting.tokens == 0


def test_added_tokens_decode_from_the_table_as_decode_reads_them() -> None:
    # The ByteLevel decoder reads an added token through its byte alphabet when every
    # character of it is in it ('café' is 'caf' and a lone byte; 'Ġhello' is ' hello').
    import os

    from tokenizers import AddedToken, Tokenizer

    from common.models.tiny import default_checkpoint
    from common.processing.token_bytes import byte_level_table

    tokenizer = Tokenizer.from_file(os.path.join(default_checkpoint("tiny"), "tokenizer.json"))
    first = tokenizer.get_vocab_size()
    added = ["café", "Ġhello", "<think>", "猫猫", "a b"]
    tokenizer.add_tokens([AddedToken(t, special=False) for t in added])
    tokenizer.add_special_tokens([AddedToken("<|spécial|>", special=True)])
    table = byte_level_table(tokenizer)
    assert table is not None

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    for token_id in range(first, tokenizer.get_vocab_size()):
        detok = IncrementalDetokenizer(decode, table)
        assert detok.add([token_id]) + detok.flush() == decode([token_id]), token_id
