"""Each token's bytes, for a byte-level BPE tokenizer (Qwen's): what `tokenizer.decode`
concatenates and reads as UTF-8, replacing what is not (`router.detokenize` decodes a stream
incrementally from them, exactly and in time linear in its tokens).

A byte-level vocabulary spells each byte as one printable character (GPT-2's
`bytes_to_unicode`); an added token is its content, read through that alphabet when every
character of it is in it (as the ByteLevel decoder reads it), and nothing when it is special
(decode skips special tokens). Any other tokenizer, or a vocabulary entry outside that alphabet, has
no table: None.
"""

from __future__ import annotations

from typing import Any


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read back: printable character -> the byte it spells."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = list(printable)
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def byte_level_table(tokenizer: Any) -> list[bytes] | None:
    """`table[id]`: the bytes token `id` decodes to (special tokens: none), for a
    `tokenizers.Tokenizer` whose decoder is ByteLevel; None for any other."""
    if type(tokenizer.decoder).__name__ != "ByteLevel":
        return None
    byte_of = _byte_of_char()
    added = tokenizer.get_added_tokens_decoder()
    table: list[bytes] = []
    for token_id in range(tokenizer.get_vocab_size()):
        token = added.get(token_id)
        if token is not None and token.special:
            table.append(b"")
            continue
        if token is not None:  # read through the byte alphabet when all of it is in it
            content = token.content
            if all(c in byte_of for c in content):
                table.append(bytes(byte_of[c] for c in content))
            else:
                table.append(content.encode("utf-8"))
            continue
        text = tokenizer.id_to_token(token_id) or ""
        try:
            table.append(bytes(byte_of[c] for c in text))
        except KeyError:  # not the byte-level alphabet: decode does something else
            return None
    return table
