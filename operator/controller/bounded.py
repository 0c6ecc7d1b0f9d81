"""Reading a trainer's answer as untrusted input: at most `LIMIT_BYTES` of it, streamed.

A trainer is the tenant's code: its `/status` (or `/profile` answer) may be any size, arrive at any
pace, and nest JSON as deep as it likes. The operator serves every job from one process and one
event loop, so one answer must never cost more than a small, fixed amount of memory and CPU:
- the body is read in chunks and the read stops as soon as it passes `LIMIT_BYTES` (a declared
  `Content-Length` above it stops the read before the first byte): the bytes held per read are
  bounded whatever the trainer sends or claims;
- the time is bounded by the caller's deadline around the whole exchange (metrics_reader.py);
- JSON too deeply nested for the parser is a refusal like any other malformed answer, not a crash.

Real answers are a few KiB (`/status` is ~2 KiB with a profile report), so 64 KiB leaves room.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

LIMIT_BYTES = 64 * 1024
CHUNK_BYTES = 16 * 1024


class Refused(ValueError):
    """The answer is too large or not JSON; the message says which."""


async def read_body(response: aiohttp.ClientResponse, limit: int = LIMIT_BYTES) -> bytes:
    """At most `limit` bytes of `response`'s body; Refused once it is larger (the rest is never read)."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise Refused(f"the answer declares {declared} bytes, more than the {limit // 1024} KiB read")
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        if len(body) > limit:
            raise Refused(f"the answer is larger than the {limit // 1024} KiB read")
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """The decoded JSON of a bounded body; Refused for anything the parser cannot take, deep nesting
    included (RecursionError is not a ValueError)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise Refused(f"the answer is not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


async def read_json(response: aiohttp.ClientResponse, limit: int = LIMIT_BYTES) -> Any:
    return parse_json(await read_body(response, limit))
