"""Request bounds at the daemon's edge: 413 before reading, 422 for deep nesting (never 500)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from runner.bounds import nesting_depth
from runner.daemon import MAX_JSON_DEPTH, Api, create_app

pytestmark = pytest.mark.anyio

TOKEN = "unit-test-service-token-5f1d2c3b"
AUTH = [(b"authorization", f"Bearer {TOKEN}".encode())]


class DurableStore:
    """Nothing is ever pending: every response may start at once (runner.durable_responses)."""

    async def sync(self) -> None:
        pass


class NoSupervisor:
    """Every bounded request is answered before the supervisor is reached (but for the
    store's flush every response waits for)."""

    store = DurableStore()

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the supervisor was reached ({name})")


def app(max_message_bytes: int = 1000, max_body_bytes: int | None = None) -> Any:
    api = Api(NoSupervisor(), SecretStr(TOKEN), max_message_bytes=max_message_bytes,  # type: ignore[arg-type]
              max_body_bytes=max_body_bytes)
    return create_app(api)


async def call(asgi: Any, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[
        int, dict[str, Any], int]:
    """Drive the ASGI app directly: returns (status, JSON body, body chunks the app pulled)."""
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        if pulled < len(chunks):
            pulled += 1
            return {"type": "http.request", "body": chunks[pulled - 1], "more_body": pulled < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": AUTH + headers, "client": ("127.0.0.1", 1), "server": ("daemon", 80)}
    await asgi(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), pulled


async def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read() -> None:
    chunks = [b"x" * 1024] * 100
    status, body, pulled = await call(app(max_body_bytes=4096), "/v1/jobs",
                                      [(b"content-length", b"102400")], chunks)
    assert (status, body, pulled) == (413, {"error": "body_too_large",
                                            "detail": {"field": "body", "limit_bytes": 4096}}, 0)


async def test_a_chunked_body_stops_being_read_at_the_limit() -> None:
    chunks = [b"x" * 1024] * 100  # no Content-Length: transfer-encoding chunked
    status, body, pulled = await call(app(max_body_bytes=4096), "/v1/jobs",
                                      [(b"transfer-encoding", b"chunked")], chunks)
    assert (status, body["error"], pulled) == (413, "body_too_large", 5)  # 5 KiB read: the first over 4 KiB


async def test_the_fork_body_is_bounded_too() -> None:
    class Store(DurableStore):
        async def get_member(self, *ids: str) -> object:
            return object()

    sup = NoSupervisor()
    object.__setattr__(sup, "store", Store())
    api = Api(sup, SecretStr(TOKEN), max_message_bytes=1000)  # type: ignore[arg-type]
    status, body, pulled = await call(create_app(api), "/v1/users/u1/chats/c1/members/m1/fork",
                                      [(b"content-length", b"1048576")], [b"{}"])
    assert (status, body["error"], pulled) == (413, "body_too_large", 0)


async def test_the_default_body_limit_leaves_room_for_a_fully_escaped_message() -> None:
    api = Api(NoSupervisor(), None, max_message_bytes=1000)  # type: ignore[arg-type]
    assert api.max_body_bytes == 6 * 1000 + 64 * 1024


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 200_000])
async def test_deep_nesting_is_a_422_naming_the_body_never_a_500(depth) -> None:
    raw = b'{"job_id": ' + b"[" * depth + b"]" * depth + b"}"
    transport = httpx.ASGITransport(app=app(max_body_bytes=1 << 20))
    async with httpx.AsyncClient(transport=transport, base_url="http://daemon") as c:
        resp = await c.post("/v1/jobs", content=raw, headers={"authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 422
    assert resp.json() == {"error": "invalid_request", "detail": [{
        "field": "body", "type": "json_too_deep",
        "message": f"nested {depth + 1} levels deep; at most {MAX_JSON_DEPTH} allowed"}]}


async def test_malformed_bodies_are_named() -> None:
    transport = httpx.ASGITransport(app=app())
    async with httpx.AsyncClient(transport=transport, base_url="http://daemon") as c:
        for raw, kind in ((b"\xff\xfe", "json_invalid"), (b'{"a": ', "json_invalid"), (b"", "json_invalid")):
            resp = await c.post("/v1/jobs", content=raw, headers={"authorization": f"Bearer {TOKEN}"})
            assert (resp.status_code, resp.json()["detail"][0]["type"]) == (422, kind), raw


@pytest.mark.parametrize(("text", "depth"), [
    ("{}", 1), ("[]", 1), ("1", 0), ('"[[[["', 0), ('{"a": [1, {"b": []}]}', 4),
    ('["\\"[[", [["]"]]]', 3), ('{"k": "\\\\"}', 1), ("[[[]], [[[]]]]", 4), ('"\\u005b"', 0),
])
def test_nesting_depth_ignores_brackets_inside_strings(text, depth) -> None:
    assert nesting_depth(text) == depth
