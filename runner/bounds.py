"""Bounds on request bodies (SPEC section 13): size before reading, JSON nesting depth.

A body is refused before it is read when its Content-Length says it is too large, and its
reading stops at the limit when it comes chunked (no Content-Length): the daemon never
holds more than ``limit`` bytes of one body. Nesting is measured without recursion before
the JSON is parsed, so a deeply nested body is a clear 422, never a ``RecursionError``.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from starlette.requests import Request

# A JSON string, escapes included (the unrolled form: linear, no backtracking).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


class BadBody(Exception):
    """Not acceptable JSON: ``kind`` is the error type a 422 names (json_invalid, json_too_deep, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes; BodyTooLarge before reading more than that."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadBody("content_length_invalid", "Content-Length is not a number") from None
        if size > limit:
            raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # what Request.body() caches: a later reader gets it instead of a consumed stream
    return body


def nesting_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting of a JSON text (strings ignored), without recursion."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def parse_json(raw: bytes, *, max_depth: int) -> Any:
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise BadBody("json_invalid", "not UTF-8") from None
    depth = nesting_depth(text)
    if depth > max_depth:
        raise BadBody("json_too_deep", f"nested {depth} levels deep; at most {max_depth} allowed")
    try:
        return json.loads(text)
    except ValueError:
        raise BadBody("json_invalid", "not JSON") from None
