"""Sends images the TypeSafe Python SDK's way (typesafe-sdk, unchanged) to a running `prism serve` of the
vision fixture (tests/fixtures/qwen35-vl-tiny): `Image(bytes)` as the whole state goes as
multipart/form-data (a `request` part with an `<image:…>` placeholder and an `asset-0` part).

Run by crates/prism-cli/tests/serve_images.rs, which starts the server, sets TYPESAFE_BASE_URL /
TYPESAFE_API_KEY / PRISM_IMAGE (the image file) and compares the answers printed here (the raw JSON the
server sent to the SDK) with the same image sent as base64 in plain JSON. Covers the sync and the async
client. Prints one JSON object on stdout; any failed check raises (exit status 1).
"""

import asyncio
import json
import os
import sys

from typesafe_sdk import AsyncTypeSafeClient, Choice, Image, Noul, RetryPolicy, TypeSafeClient, __version__

QUESTIONS = {
    "busy": Noul(instructions="Is the dock in use?"),
    "what": Choice(instructions="What does it show?", criteria={"a truck": None, "a person": None, "nothing": None}),
}
NO_RETRY = RetryPolicy(max_retries=0)


def check(result) -> dict:
    assert result.request_id.startswith("req_"), result.request_id
    busy = result.nouls["busy"]
    assert 0 < busy.noul < 1, busy
    what = result.choices["what"]
    assert what.choice in {"a truck", "a person", "nothing"}, what
    assert abs(sum(what.probabilities.values()) - 1) < 1e-9, what
    assert result.usage.input_tokens > 64, result.usage  # the image's 64 tokens are counted
    raw = result.raw_http_response
    content_type = raw.request.headers.get("content-type", "")
    assert content_type.startswith("multipart/form-data"), content_type
    return raw.json()


async def check_async(image: bytes) -> dict:
    async with AsyncTypeSafeClient(retry=NO_RETRY) as client:
        return check(await client.system_one(state=Image(image), questions=QUESTIONS))


def main() -> None:
    with open(os.environ["PRISM_IMAGE"], "rb") as f:
        image = f.read()
    with TypeSafeClient(retry=NO_RETRY) as client:
        body = check(client.system_one(state=Image(image), questions=QUESTIONS))
    async_body = asyncio.run(check_async(image))
    assert body["answers"] == async_body["answers"], "sync and async clients answered differently"
    json.dump(
        {"sdk_version": __version__, "answers": body["answers"], "usage": body["usage"]},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
