"""The model proxy on real unix sockets in front of the real loopback fixture (in-process):
streaming, status pass-through, the key swap, the allow-list, chat attribution, the wire
records, and bad input that never reaches another sandbox."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import anyio
import httpx
import pytest
import structlog

from deploy.loopback import LoopbackFixture, expected_default_reply, fail, reject, stall
from deploy.loopback.recorder import fingerprint
from proxy import DigestEntry
from telemetry.metrics import exposition
from tests.support.metrics import sample
from tests.support.proxy_harness import REAL_KEY, Jobs, ListSink, raw_exchange, running_proxy, uds_client

pytestmark = pytest.mark.anyio

ANTHROPIC = {"model": "m", "stream": True, "max_tokens": 64,
             "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                                       {"type": "text", "text": "hello there"}]}]}
CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi chat"}]}
RESPONSES = {"model": "m", "stream": True, "input": [{"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "hi codex"}]}]}


@pytest.fixture
def fx(tmp_path: Path):
    with LoopbackFixture.start(record_path=str(tmp_path / "fixture.jsonl")) as f:
        yield f


@pytest.fixture
def sink() -> ListSink:
    return ListSink()


def finished_seqs(path: Path) -> list[int]:
    """Requests the fixture has *finished* (its JSONL line is written at the end of a request)."""
    if not path.exists():
        return []
    return [json.loads(line)["seq"] for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- streaming and pass-through


async def test_sse_streams_through_chunk_by_chunk(fx: LoopbackFixture, tmp_path: Path, sink: ListSink) -> None:
    """The first SSE event reaches the sandbox while the upstream is still answering."""
    fx.add_rule(stall(1.0, match="hello there"))
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        async with uds_client(path) as client, client.stream(
                "POST", "/m/mem1/v1/messages?beta=true", json=ANTHROPIC, headers={"x-api-key": "ca-placeholder"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks = r.aiter_raw()
            first = await chunks.__anext__()
            assert first.startswith(b"event: message_start\n")
            assert finished_seqs(tmp_path / "fixture.jsonl") == []  # the upstream has not finished
            rest = b"".join([c async for c in chunks])
        await host.flush("chat-a")
    assert finished_seqs(tmp_path / "fixture.jsonl") == [1]
    body = (first + rest).decode()
    reply = expected_default_reply(["hello there"])
    assert body.count("event: content_block_delta") >= 1 and body.rstrip().endswith('data: {"type":"message_stop"}')
    [rec] = sink.records
    assert (rec.route, rec.kind, rec.status, rec.upstream_request_id) == ("anthropic.messages", "conversation", 200,
                                                                          "req_fx000001")
    assert rec.digest == [DigestEntry.text("user", "hello there")]
    assert rec.reply == [DigestEntry.text("assistant", reply)]
    assert rec.bytes_out == len(first + rest) and rec.bytes_in > 0


@pytest.mark.parametrize("rule,status,reason", [
    (fail(429, retry_after=7, message="slow down"), 429, "Too Many Requests"),
    (fail(529, message="overloaded now"), 529, "Overloaded"),
    (reject(message="terminal: bad request"), 400, "Bad Request"),
])
async def test_error_statuses_pass_through_with_their_bodies(fx: LoopbackFixture, tmp_path: Path, sink: ListSink,
                                                             rule, status: int, reason: str) -> None:
    fx.add_rule(rule)
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        async with uds_client(path) as client:
            via_proxy = await client.post("/m/m1/v1/chat/completions", json=CHAT)
        fx.reset(requests=False, rules=True)
        fx.add_rule(rule)
        async with httpx.AsyncClient() as direct_client:
            direct = await direct_client.post(f"{fx.base_url}/v1/chat/completions", json=CHAT)
    assert (via_proxy.status_code, via_proxy.reason_phrase) == (status, reason)
    assert via_proxy.status_code == direct.status_code
    # the body is the fixture's, byte for byte, apart from the per-request id
    assert via_proxy.json() == json.loads(direct.text.replace("req_fx000002", "req_fx000001"))
    for header in ("retry-after", "content-type"):
        assert via_proxy.headers.get(header) == direct.headers.get(header)
    assert via_proxy.headers["x-request-id"] == "req_fx000001"
    assert [(r.status, r.upstream_request_id) for r in sink.records] == [(status, "req_fx000001")]


async def test_the_real_key_arrives_and_the_placeholder_never_does(fx: LoopbackFixture, tmp_path: Path) -> None:
    async with running_proxy(fx.base_url, tmp_path) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        async with uds_client(path) as client:
            sent = {"x-api-key": "ca-placeholder-1", "authorization": "Bearer ca-placeholder-2",
                    "api-key": "ca-placeholder-3", "cookie": "session=ca-placeholder-4"}
            assert (await client.post("/m/m1/v1/messages?beta=true", json=ANTHROPIC, headers=sent)).status_code == 200
            assert (await client.post("/m/m1/v1/responses", json=RESPONSES, headers=sent)).status_code == 200
            assert (await client.post("/m/m1/v1/chat/completions", json=CHAT, headers=sent)).status_code == 200
            assert (await client.head("/m/m1/api/hello", headers=sent)).status_code == 200
    creds = [(r.method, r.path, r.query, r.credentials) for r in fx.requests()]
    assert creds == [
        ("POST", "/v1/messages", "beta=true", {"x-api-key": fingerprint(REAL_KEY)}),
        ("POST", "/v1/responses", "", {"authorization": "Bearer " + fingerprint(REAL_KEY)}),
        ("POST", "/v1/chat/completions", "", {"authorization": "Bearer " + fingerprint(REAL_KEY)}),
        ("HEAD", "/api/hello", "", {"x-api-key": fingerprint(REAL_KEY)}),
    ]


async def test_an_upstream_that_echoes_the_key_is_redacted(fx: LoopbackFixture, tmp_path: Path) -> None:
    fx.add_rule(fail(401, message=f"invalid key {REAL_KEY}"))
    with structlog.testing.capture_logs() as logs:
        async with running_proxy(fx.base_url, tmp_path, sink=(sink := ListSink()), capture=True) as host:
            path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
            async with uds_client(path) as client:
                r = await client.post("/m/m1/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer p"})
    assert r.status_code == 401 and "invalid key [redacted]" in r.text and REAL_KEY not in r.text
    assert REAL_KEY not in json.dumps(logs, default=str)
    assert REAL_KEY not in "".join(rec.model_dump_json() for rec in sink.records)


# ---------------------------------------------------------------- allow-list and attribution


@pytest.mark.parametrize("method,target", [
    ("GET", "/m/m1/_fixture/requests"), ("POST", "/m/m1/_fixture/rules"), ("POST", "/m/m1/_fixture/reset"),
    ("GET", "/_fixture/requests"), ("POST", "/v1/messages"), ("GET", "/m/m1/v1/messages"),
    ("POST", "/m/m1/v1/../_fixture/rules"), ("GET", "/m/m1/metrics"),
])
async def test_non_model_paths_are_403_and_counted(fx: LoopbackFixture, tmp_path: Path, sink: ListSink, method: str,
                                                   target: str) -> None:
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        async with uds_client(path) as client:
            r = await client.request(method, target, content=b'{"rules": [], "replace": true}')
        denied = host.metrics.registry.get_sample_value("cloud_agent_proxy_denied_total",
                                                        {"reason": "no_member" if "/m/" not in target
                                                         else "not_a_model_route"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden"
    assert denied == 1
    assert fx.requests() == [] and fx.rules() == []  # nothing reached the fixture
    assert [(x.status, x.route) for x in sink.records] == [(403, None)]


async def test_a_request_on_chat_as_socket_is_chat_a(fx: LoopbackFixture, tmp_path: Path, sink: ListSink) -> None:
    jobs = Jobs()
    jobs.running = {("chat-a", "m1"): "job-a", ("chat-b", "m1"): "job-b", ("chat-b", "mb"): "job-b2"}
    async with running_proxy(fx.base_url, tmp_path, sink=sink, jobs=jobs) as host:
        a = await host.open_sandbox("chat-a", tmp_path / "a", user_id="ua")
        b = await host.open_sandbox("chat-b", tmp_path / "b", user_id="ub")
        assert a != b and a.parent != b.parent
        async with uds_client(a) as client:
            # nothing the sandbox sends can name another chat: B's member key, headers naming B
            await client.post("/m/mb/v1/chat/completions", json=CHAT,
                              headers={"x-cloud-agent-chat": "chat-b", "host": "chat-b"})
            await client.post("/m/m1/v1/chat/completions", json=CHAT)
        async with uds_client(b) as client:
            await client.post("/m/m1/v1/chat/completions", json=CHAT)
        await host.flush("chat-a")
        await host.flush("chat-b")
    assert [(r.chat_key, r.member_key, r.job_id) for r in sink.records] == [
        ("chat-a", "mb", None), ("chat-a", "m1", "job-a"), ("chat-b", "m1", "job-b")]


# ---------------------------------------------------------------- records


async def test_records_of_all_three_shapes_with_capture(fx: LoopbackFixture, tmp_path: Path, sink: ListSink) -> None:
    jobs = Jobs()
    jobs.running[("chat-a", "m1")] = "job-1"
    async with running_proxy(fx.base_url, tmp_path, sink=sink, jobs=jobs, capture=True) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        async with uds_client(path) as client:
            await client.head("/m/m1/api/hello")
            await client.post("/m/m1/v1/messages?beta=true", json=ANTHROPIC)
            await client.post("/m/m1/v1/responses", json=RESPONSES)
            await client.post("/m/m1/v1/chat/completions", json=CHAT)
    got = [(r.method, r.path, r.api, r.kind, r.side, r.job_id, [c.text for c in r.capture or []],
            [c.text for c in r.reply_capture or []]) for r in sink.records]
    assert got == [
        ("HEAD", "/api/hello", None, "probe", True, "job-1", [], []),
        ("POST", "/v1/messages", "anthropic", "conversation", False, "job-1", ["hello there"],
         [expected_default_reply(["hello there"])]),
        ("POST", "/v1/responses", "responses", "conversation", False, "job-1", ["hi codex"],
         [expected_default_reply(["hi codex"])]),
        ("POST", "/v1/chat/completions", "chat", "conversation", False, "job-1", ["hi chat"],
         [expected_default_reply(["hi chat"])]),
    ]
    assert [r.seq for r in sink.records] == sorted(r.seq for r in sink.records)


async def test_without_capture_records_hold_digests_only(fx: LoopbackFixture, tmp_path: Path, sink: ListSink) -> None:
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        async with uds_client(path) as client:
            await client.post("/m/m1/v1/chat/completions", json=CHAT)
    [rec] = sink.records
    assert rec.capture is None and rec.reply_capture is None
    assert "hi chat" not in rec.model_dump_json()
    assert rec.digest == [DigestEntry.text("user", "hi chat")]


# ---------------------------------------------------------------- the socket


async def test_socket_is_for_uid_1000_and_comes_back_at_the_same_path(fx: LoopbackFixture, tmp_path: Path) -> None:
    directory = tmp_path / "a"
    async with running_proxy(fx.base_url, tmp_path) as host:
        path = await host.open_sandbox("chat-a", directory, user_id="u1")
        assert await host.open_sandbox("chat-a", directory, user_id="u1") == path  # idempotent
        st = path.stat()
        assert stat.S_ISSOCK(st.st_mode)
        if os.geteuid() == 0:
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o660)
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755
    # a daemon killed without cleaning up leaves a stale socket file behind
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    assert path.exists()
    async with running_proxy(fx.base_url, tmp_path) as host:
        assert await host.open_sandbox("chat-a", directory, user_id="u1") == path
        async with uds_client(path) as client:
            assert (await client.post("/m/m1/v1/chat/completions", json=CHAT)).status_code == 200
        await host.close_sandbox("chat-a")
        assert not path.exists()
        (directory / "model.sock").write_text("not a socket")
        with pytest.raises(FileExistsError, match="not a socket"):
            await host.open_sandbox("chat-a", directory, user_id="u1")


async def test_a_members_follow_up_is_audited_from_its_last_request_until_its_chat_closes(
        fx: LoopbackFixture, tmp_path: Path) -> None:
    """The host's audit memo (proxy/audit_memo.py) through real exchanges: the follow-up's
    messages shared with the member's last request are counted remembered, the rest walked,
    and closing the chat's socket gives its members' messages back."""
    sink = ListSink()
    first = [{"role": "user", "content": "hi chat"}]
    follow = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        async with uds_client(path) as client:
            for messages in (first, follow):
                reply = await client.post("/m/m1/v1/chat/completions", json=CHAT | {"messages": messages})
                assert reply.status_code == 200
        await host.flush("chat-a")
        text = exposition(host.metrics.registry, "")[0].decode()
        assert sample(text, "cloud_agent_proxy_audited_messages_total", how="walked") == 1 + 2
        assert sample(text, "cloud_agent_proxy_audited_messages_total", how="remembered") == 1
        assert [len(r.digest or []) for r in sink.records] == [1, 3]
        memo = host._ctx.audit_memo  # noqa: SLF001 - what the host holds
        assert memo is not None and len(memo) == 1
        await host.close_sandbox("chat-a")
        assert (len(memo), memo.bytes) == (0, 0)


# ---------------------------------------------------------------- bad input


async def test_bad_input_gets_a_bounded_answer_and_never_affects_another_sandbox(
        fx: LoopbackFixture, tmp_path: Path, sink: ListSink) -> None:
    """While sandbox A sends garbage, an oversized body, a trickling head and abandons a stream,
    sandbox B's streamed request completes normally."""
    fx.add_rule(stall(1.5, match="abandon me"))
    async with running_proxy(fx.base_url, tmp_path, sink=sink, max_body_bytes=4096, head_timeout_s=0.5) as host:
        a = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        b = await host.open_sandbox("chat-b", tmp_path / "b", user_id="u2")
        results: dict[str, object] = {}

        async def sandbox_b() -> None:
            async with uds_client(b) as client:
                r = await client.post("/m/m1/v1/chat/completions", json=CHAT)
                results["b"] = (r.status_code, r.text.rstrip().endswith("data: [DONE]"))

        async def sandbox_a() -> None:
            results["garbage"] = await raw_exchange(a, b"\x16\x03\x01 not http at all\r\n\r\n")
            big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
            results["too_large"] = await raw_exchange(
                a, b"POST /m/m1/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(big) + big)
            chunked = (b"POST /m/m1/v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                       + b"".join(b"400\r\n" + b"y" * 1024 + b"\r\n" for _ in range(6)))
            results["too_large_chunked"] = await raw_exchange(a, chunked)
            async with await anyio.connect_unix(str(a)) as slow:  # a head that never completes
                await slow.send(b"POST /m/m1/v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                results["slow"] = await slow.receive()
            async with uds_client(a) as client:  # leaves in the middle of a stream
                abandon = {**CHAT, "messages": [{"role": "user", "content": "abandon me"}]}
                async with client.stream("POST", "/m/m1/v1/chat/completions", json=abandon) as r:
                    results["first_event"] = await r.aiter_raw().__anext__()

        async with anyio.create_task_group() as tg:
            tg.start_soon(sandbox_a)
            tg.start_soon(sandbox_b)
        await anyio.to_thread.run_sync(lambda: fx.wait_for(lambda recs: any(r.error for r in recs), timeout=10))
        await host.flush("chat-a")
        rejected = {reason: host.metrics.registry.get_sample_value("cloud_agent_proxy_rejected_total",
                                                                   {"reason": reason})
                    for reason in ("bad_request", "body_too_large", "request_timeout")}
    assert results["b"] == (200, True)
    [b_rec] = sink.for_chat("chat-b")
    b_reply = DigestEntry.text("assistant", expected_default_reply(["hi chat"]))
    assert (b_rec.status, b_rec.error, b_rec.reply) == (200, None, [b_reply])
    assert bytes(results["garbage"]).startswith(b"HTTP/1.1 400 ")  # type: ignore[arg-type]
    assert bytes(results["too_large"]).startswith(b"HTTP/1.1 413 ")  # type: ignore[arg-type]
    assert b"larger than 4096 bytes" in bytes(results["too_large_chunked"])  # type: ignore[arg-type]
    assert bytes(results["too_large_chunked"]).startswith(b"HTTP/1.1 413 ")  # type: ignore[arg-type]
    assert bytes(results["slow"]).startswith(b"HTTP/1.1 408 ")  # type: ignore[arg-type]
    assert bytes(results["first_event"]).startswith(b"data: ")  # type: ignore[arg-type]
    assert rejected == {"bad_request": 1, "body_too_large": 2, "request_timeout": 1}
    # the abandoned request was cancelled upstream: the fixture saw its client go away; the
    # oversized bodies never reached it
    assert [(r.error or "").startswith("client went away") for r in fx.requests()] == [False, True]
    assert "abandon me" in json.dumps(fx.requests()[1].body)
    assert [r.error for r in sink.for_chat("chat-a") if r.error and r.error.startswith("client_gone")]


async def test_keep_alive_and_chunked_request_bodies(fx: LoopbackFixture, tmp_path: Path, sink: ListSink) -> None:
    body = json.dumps(CHAT).encode()
    half = len(body) // 2
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
    data = (b"POST /m/m1/v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + chunked
            + b"POST /m/m1/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(body) + body)
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        out = await raw_exchange(path, data)
    assert out.count(b"HTTP/1.1 200 ") == 2 and out.count(b"data: [DONE]") == 2
    assert [r.body for r in fx.requests()] == [CHAT, CHAT]
    assert [(r.status, r.bytes_in) for r in sink.records] == [(200, len(body)), (200, len(body))]


async def test_an_unreachable_gateway_is_a_502_and_a_missing_key_a_503(tmp_path: Path, sink: ListSink) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with running_proxy(f"http://127.0.0.1:{port}", tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        async with uds_client(path) as client:
            r = await client.post("/m/m1/v1/chat/completions", json=CHAT)
            assert (r.status_code, r.json()["error"]["type"]) == (502, "upstream_unreachable")
        (tmp_path / "gateway.key").unlink()
        host._keys._cache.clear()  # noqa: SLF001 - do not wait for the re-read interval
        async with uds_client(path) as client:
            r = await client.post("/m/m1/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["error"]["type"]) == (503, "gateway_key_unavailable")
    assert "CLOUD_AGENT_GATEWAY_KEY_FILE" in r.json()["error"]["message"]
    assert [x.status for x in sink.records] == [502, 503]


async def test_a_malformed_chunked_body_is_a_400_and_never_forwarded(fx: LoopbackFixture, tmp_path: Path,
                                                                     sink: ListSink) -> None:
    data = (b"POST /m/m1/v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            b"zz\r\nnot a chunk size\r\n0\r\n\r\n")
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="u1")
        out = await raw_exchange(path, data)
    assert out.startswith(b"HTTP/1.1 400 ") and b"malformed request body" in out
    assert fx.requests() == []
    assert [(r.status, r.error) for r in sink.records] == [(400, "bad_request")]
