"""`GenerateRequest.resume_tokens` (a client resuming a stream on another router): the
router's check names the field; a resumed stream sends only what follows the tokens, and its
text is what the uninterrupted stream would have sent after them, also when the tokens end
inside a character, and whatever the chunks (several tokens each: a decode worker's
`stream_interval`) either router sent (a router in this event loop with `tests.test_router`'s
fake workers)."""

from __future__ import annotations

import grpc
import pytest

from common.roles import Role
from common.sampling import SamplingParams
from epd.request import build_request
from epd.v1 import decode_service_pb2, router_service_pb2
from router.decode import check_resume
from router.detokenize import IncrementalDetokenizer
from router.inputs import InputError
from tests import test_router
from tests.test_router import TEXT, FakeDecode, FakeEncoder, FakePrefill

ckpt = test_router.ckpt


def _request(tokens: list[int], stop: tuple[str, ...] = ()) -> router_service_pb2.GenerateRequest:
    return router_service_pb2.GenerateRequest(resume_tokens=tokens, stop=list(stop))


def test_no_resume_tokens_is_a_fresh_request() -> None:
    assert check_resume(_request([]), 8) == ()


def test_resume_tokens_come_back_in_order() -> None:
    assert check_resume(_request([5, 3, 9]), 8) == (5, 3, 9)


@pytest.mark.parametrize(
    ("tokens", "stop", "reason"),
    [
        ([1] * 8, (), "leave none to generate (max_tokens=8)"),
        ([4, -1], (), "must not be negative"),
        ([4], ("END",), "stop strings cannot be resumed"),
        ([4, 100], (), "token id 100 is outside the vocab"),
    ],
)
def test_bad_resume_tokens_are_refused_naming_the_field(
    tokens: list[int], stop: tuple[str, ...], reason: str
) -> None:
    with pytest.raises(InputError) as info:
        check_resume(_request(tokens, stop), 8, vocab_size=100)
    assert info.value.field == "resume_tokens" and reason in str(info.value)


class ScriptedDecode(FakeDecode):
    """Streams `tokens` after the resumed ones, `interval` a chunk, the last chunk with a
    finish reason."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []
        self.interval = 1

    async def Decode(self, request, context):
        self.requests.append(request)
        yield decode_service_pb2.DecodeResponse(blocks_pulled=1)
        for k in range(0, len(self.tokens), self.interval):
            last = k + self.interval >= len(self.tokens)
            yield decode_service_pb2.DecodeResponse(
                token_ids=self.tokens[k : k + self.interval],
                finish_reason=decode_service_pb2.FINISH_REASON_LENGTH if last else 0,
            )


@pytest.mark.parametrize("interval", [1, 2, 3])
async def test_a_resumed_streams_text_is_the_uninterrupted_ones_at_every_split(
    ckpt, interval: int
) -> None:
    """Resumed after each chunk (the first token alone, then `interval` tokens a chunk;
    several end inside "é" or "猫"), the text the client gets on the new router completes
    exactly the text it had (what the first router sent, chunk by chunk) to the whole answer:
    no character lost, none sent twice, no U+FFFD."""
    cluster = await test_router.start_router(ckpt)
    try:
        decode = ScriptedDecode()
        await cluster.add(Role.ENCODER, FakeEncoder())
        await cluster.add(Role.PREFILL, FakePrefill())
        await cluster.add(Role.DECODE, decode)
        decode_ids = cluster.router.orchestrator.processor.decode
        answer = "a é 猫 b"
        ids = cluster.router.orchestrator.processor.tokenizer.encode(answer).ids
        assert decode_ids(ids) == answer and len(ids) > len(answer)  # characters split
        decode.interval = interval
        for split in range(1, len(ids), interval):
            first_router = IncrementalDetokenizer(decode_ids)
            chunks = [ids[:1]] + [ids[k : k + interval] for k in range(1, split, interval)]
            had = "".join(first_router.add(chunk) for chunk in chunks)
            decode.tokens = ids[split:]
            request = build_request(TEXT, SamplingParams(max_tokens=len(ids) + 1))
            request.resume_tokens.extend(ids[:split])
            tokens, text = [], ""
            async for chunk in cluster.client._router.Generate(request):
                tokens += chunk.token_ids
                text += chunk.text
            assert tokens == ids[split:], split
            assert had + text == answer, (split, had, text)
    finally:
        await cluster.close()


def test_too_many_resume_tokens_are_refused_by_their_count_before_any_is_copied() -> None:
    # Checked on the event loop: 250 million tokens were made a tuple first (6.5 s).
    import types

    class Many:
        def __len__(self) -> int:
            return 250_000_000

        def __iter__(self) -> None:
            raise AssertionError("copied")

    request = types.SimpleNamespace(resume_tokens=Many(), stop=[])
    with pytest.raises(InputError, match="250000000 tokens leave none"):
        check_resume(request, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [[4, 7], [7], [4, 9]])
def test_resume_tokens_that_already_end_the_answer_are_refused_up_front(
    tokens: list[int],
) -> None:
    # Refused only by the decode worker, after the prompt was encoded and prefilled, as its
    # failure ("decode failed: ...", no epd-field); and a first token that ended the answer
    # was taken (nodeclient review, s33). 7: an EOS; 9: a stop token of the request's.
    from common.sampling import StopChecker

    ends = (StopChecker(frozenset({7})), SamplingParams(max_tokens=8, stop_token_ids=(9,)))
    with pytest.raises(InputError) as info:
        check_resume(_request(tokens), 8, vocab_size=100, ends=ends)
    assert info.value.field == "resume_tokens"
    assert f"already ended at token {len(tokens) - 1}" in str(info.value)
    assert check_resume(_request([4, 5]), 8, vocab_size=100, ends=ends) == (4, 5)


async def test_a_router_refuses_a_resume_that_already_ended_before_any_worker(ckpt) -> None:
    cluster = await test_router.start_router(ckpt)
    try:
        prefill = FakePrefill()
        await cluster.add(Role.ENCODER, FakeEncoder())
        await cluster.add(Role.PREFILL, prefill)
        await cluster.add(Role.DECODE, FakeDecode())
        eos = cluster.router.orchestrator.processor.config.eos_token_ids[0]
        request = build_request(TEXT, SamplingParams(max_tokens=8))
        request.resume_tokens.extend([4, eos])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in cluster.client._router.Generate(request):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("epd-field", "resume_tokens") in tuple(info.value.trailing_metadata() or ())
        assert prefill.requests == []
    finally:
        await cluster.close()


def test_first_end_finds_the_first_ending_token_by_set_lookups() -> None:
    # Token by token against a tuple of up to 1024 stop ids, a 262k-token resume held the
    # router's event loop 2.8 s (own-fix review 2); the answer is the same.
    from common.sampling import StopChecker

    stop = StopChecker(frozenset({7}))
    ids = tuple(range(1000, 2024))
    assert stop.first_end(SamplingParams(stop_token_ids=ids), [4, 5, 1500, 7]) == 2
    assert stop.first_end(SamplingParams(), [4, 5, 7, 7]) == 2
    assert stop.first_end(SamplingParams(ignore_eos=True), [4, 5, 7]) is None
    assert stop.first_end(SamplingParams(stop_token_ids=ids), list(range(8, 999)) * 200) is None
