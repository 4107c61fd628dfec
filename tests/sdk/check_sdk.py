"""Drives a running `prism serve` with the official TypeSafe Python SDK (typesafe-sdk), unchanged.

Run by crates/prism-cli/tests/serve_sdk.rs, which starts the server (with an API key), sets
TYPESAFE_BASE_URL / TYPESAFE_API_KEY / PRISM_EXPECTED_MODEL, and compares the answers printed here (the raw
JSON the server sent to the SDK) with the answers to the same request sent as plain JSON over a socket.

Covers: choice, noul and score questions through the sync and the async client, the zstd request
compression the SDK applies to bodies of 1 KiB or more, the request-id header, /v1/models, a 422 read as the
SDK's typed error, and an image sent the SDK's way (multipart/form-data), refused with 422.
Prints one JSON object on stdout; any failed check raises (exit status 1).
"""

import asyncio
import json
import os
import struct
import sys
import zlib

from typesafe_sdk import (
    AsyncTypeSafeClient,
    Choice,
    Image,
    Noul,
    RetryPolicy,
    Score,
    TypeSafeClient,
    TypeSafeUnprocessableEntityError,
    __version__,
)
from typesafe_sdk._core.compression import COMPRESSORS

# Long enough (over 1 KiB once serialized) that the SDK compresses the body with zstd.
STATE = {
    "ticket": "I was charged twice for my March invoice and the app now says my card is declined. " * 12,
    "customer": {"plan": "pro", "seats": 12},
}
QUESTIONS = {
    "team": Choice(
        instructions="Which team should handle this ticket?",
        criteria={"billing": "Payments and invoices", "technical": "Bugs and outages", "sales": None},
    ),
    "urgent": Noul(instructions="Does this ticket need a reply today?"),
    "mood": Score(instructions="How upset is the customer?", criteria=["calm", "annoyed", "angry"]),
}
NO_RETRY = RetryPolicy(max_retries=0)


def tiny_png() -> bytes:
    """A valid 1x1 grey PNG."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b"")


def check_response(result, expected_model: str) -> dict:
    assert result.model == expected_model, result.model
    assert result.request_id.startswith("req_"), result.request_id
    team = result.choices["team"]
    assert team.choice in {"billing", "technical", "sales"}, team
    assert abs(sum(team.probabilities.values()) - 1) < 1e-9, team
    assert 0 <= team.confidence <= 1, team
    urgent = result.nouls["urgent"]
    assert 0 < urgent.noul < 1, urgent
    mood = result.scores["mood"]
    assert set(mood.legend) == {0, 1, 2} and mood.legend[2] == "angry", mood
    assert abs(mood.score - sum(level * p for level, p in mood.probabilities.items())) < 1e-12, mood
    assert result.usage.input_tokens > 0 and result.usage.output_tokens == 0, result.usage
    raw = result.raw_http_response
    # The SDK compressed the request body (it is over 1 KiB) with zstd.
    assert raw.request.headers.get("content-encoding") == "zstd", dict(raw.request.headers)
    return raw.json()["answers"]


def check_sync(expected_model: str) -> dict:
    with TypeSafeClient(retry=NO_RETRY) as client:
        models = client.models.list()
        assert [m.name for m in models.models] == [expected_model], models
        answers = check_response(client.system_one(state=STATE, questions=QUESTIONS), expected_model)

        try:
            client.system_one(
                state="x", questions={"rating": Score(instructions="Rate it.", criteria=[str(i) for i in range(11)])}
            )
            raise AssertionError("a score of 11 levels was answered")
        except TypeSafeUnprocessableEntityError as error:
            assert error.status == 422 and error.request_id.startswith("req_"), error
            assert "more than 10 levels" in str(error), str(error)

        # An image goes as multipart/form-data (a `request` part and an `asset-0` part): parsed, then
        # refused because the engine has no vision tower yet.
        try:
            client.system_one(state=Image(tiny_png()), questions={"photo": Noul(instructions="Is it grey?")})
            raise AssertionError("an image was answered")
        except TypeSafeUnprocessableEntityError as error:
            assert "vision tower" in str(error), str(error)
            sent = error.headers  # the response's headers
            assert sent.get("x-typesafe-request-id", "").startswith("req_"), dict(sent)
    # Uncompressed bodies work too.
    with TypeSafeClient(retry=NO_RETRY, compression=False) as client:
        plain = client.system_one(state=STATE, questions=QUESTIONS)
        assert plain.raw_http_response.request.headers.get("content-encoding") is None
        assert plain.raw_http_response.json()["answers"] == answers
    return answers


async def check_async(expected_model: str) -> dict:
    async with AsyncTypeSafeClient(retry=NO_RETRY) as client:
        models = await client.models.list()
        assert [m.name for m in models.models] == [expected_model], models
        results = await asyncio.gather(*(client.system_one(state=STATE, questions=QUESTIONS) for _ in range(4)))
        answers = [check_response(result, expected_model) for result in results]
        assert all(a == answers[0] for a in answers), "concurrent async calls answered differently"
        try:
            await client.system_one(state=Image(tiny_png()), questions={"photo": Noul(instructions="Is it grey?")})
            raise AssertionError("an image was answered")
        except TypeSafeUnprocessableEntityError as error:
            assert "vision tower" in str(error), str(error)
        return answers[0]


def main() -> None:
    assert "zstd" in COMPRESSORS, "install typesafe-sdk[zstd] (backports.zstd) so the SDK compresses bodies"
    expected_model = os.environ["PRISM_EXPECTED_MODEL"]
    sync_answers = check_sync(expected_model)
    async_answers = asyncio.run(check_async(expected_model))
    assert sync_answers == async_answers, "sync and async clients answered differently"
    json.dump({"sdk_version": __version__, "state": STATE, "answers": sync_answers}, sys.stdout)


if __name__ == "__main__":
    main()
