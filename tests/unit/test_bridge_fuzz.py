"""Garbled stdin lines, SSE events and REST answers never crash or wedge the bridge."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.bridge_replay import bridge_module

B = bridge_module()
S = "ses_root0000000001"

EVENT_TYPES = ["server.connected", "server.heartbeat", "message.updated", "message.part.updated",
               "message.part.delta", "message.part.removed", "message.removed", "session.status", "session.idle",
               "session.error", "session.created", "session.updated", "session.turn.close", "permission.asked",
               "question.asked", "session.network.asked", "sync", "plugin.added"]
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12) | \
    st.sampled_from([S, "ses_child000000001", "msg_22a000000001Uuuuuuuuuuuuuu", "msg_a1", "prt_1", "per_1", "que_1",
                     "user", "assistant", "text", "tool", "idle", "busy", "task"])
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.sampled_from(["id", "sessionID", "messageID", "partID", "parentID", "role", "type", "text", "delta", "field",
                     "info", "part", "status", "time", "completed", "error", "synthetic", "state", "metadata",
                     "sessionId", "tool", "questions", "options", "label", "message", "name", "data"]), kids,
    max_size=6), max_leaves=25)
events = st.fixed_dictionaries({"type": st.sampled_from(EVENT_TYPES)}, optional={"properties": json_value}) | json_value


class AnyRest:
    """Answers every call with a drawn value (or a failure)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers or [None]
        self.n = 0

    def call(self, method: str, path: str, body: Any = None, timeout: float = 0.0) -> Any:
        self.n += 1
        if self.n <= 2:  # status check + prompt_async: the turn starts, so events reach its logic
            return {} if self.n == 1 else None
        answer = self.answers[self.n % len(self.answers)]
        if answer == "FAIL":
            raise B.HttpError(500, "x")
        return answer


class NoStream:
    def cut(self) -> None:
        pass


def make(answers: list[Any]) -> tuple[Any, list[dict[str, Any]], list[float]]:
    out: list[dict[str, Any]] = []
    now = [0.0]
    bridge = B.Bridge("kilo", AnyRest(answers), out.append, NoStream(), clock=lambda: now[0], sleep=lambda _s: None,
                      test_seams=True)
    return bridge, out, now


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.binary(max_size=60) | st.builds(lambda v: json.dumps(v).encode(), json_value), max_size=12),
       answers=st.lists(json_value | st.just("FAIL"), max_size=5))
def test_garbled_stdin_never_crashes(lines: list[bytes], answers: list[Any]) -> None:
    bridge, out, now = make(answers)
    bridge.on_event(1, {"type": "server.connected"})
    for line in lines:
        bridge.on_line(line)
        now[0] += 1
        bridge.on_tick()
    assert all(isinstance(o, dict) and isinstance(o.get("type"), str) for o in out)
    json.dumps(out)  # every line is serialisable


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(evs=st.lists(events, max_size=25), answers=st.lists(json_value | st.just("FAIL"), max_size=5),
       downs=st.lists(st.integers(min_value=0, max_value=24), max_size=2))
def test_garbled_events_never_crash(evs: list[Any], answers: list[Any], downs: list[int]) -> None:
    bridge, out, now = make(answers + [{}])
    bridge.on_event(1, {"type": "server.connected"})
    bridge.session = S
    bridge.on_line(b'{"type":"prompt","turn_id":"t1","text":"hi"}')
    for i, ev in enumerate(evs):
        if i in downs:
            bridge.on_stream_down(1, "fuzz")
        bridge.on_event(1, ev)
        now[0] += 0.7
        bridge.on_tick()
    for _ in range(40):  # time passes: every pending judgement resolves, nothing waits forever
        now[0] += 1
        bridge.on_tick()
    assert all(isinstance(o, dict) and isinstance(o.get("type"), str) for o in out)
    json.dumps(out)
    if bridge.turn is not None:
        # still running only while the stream is live and no native idle was seen
        assert bridge.turn.lost_at is None


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=200))
def test_sse_parser_never_crashes(payload: bytes) -> None:
    import io
    import queue

    q: queue.Queue[Any] = queue.Queue()
    stream = B.EventStream(0, None, q)

    class Resp:
        status = 200

        def __init__(self) -> None:
            self.buf = io.BytesIO(payload + b"\n\ndata: {\"type\":\"x\"}\n\n")

        def readline(self, limit: int = -1) -> bytes:
            return self.buf.readline(limit)

    class Conn:
        sock = None

        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def request(self, *a: Any, **k: Any) -> None:
            pass

        def getresponse(self) -> Resp:
            return Resp()

        def close(self) -> None:
            pass

    real = B.http.client.HTTPConnection
    B.http.client.HTTPConnection = Conn
    try:
        stream._read(1)
    finally:
        B.http.client.HTTPConnection = real
    items = []
    while not q.empty():
        items.append(q.get())
    assert items and items[-1] == ("sse", 1, {"type": "x"})


def test_unhashable_and_odd_ids_are_ignored() -> None:
    """Regression: ids that are lists/objects must not reach dict or set lookups."""
    bridge, out, now = make([{}])
    bridge.on_event(1, {"type": "server.connected"})
    bridge.session = S
    bridge.on_line(b'{"type":"prompt","turn_id":"t1","text":"hi"}')
    odd: list[Any] = [[1], {"a": 1}, 3.5, None]
    for value in odd:
        for ev in ({"type": "message.removed", "properties": {"messageID": value}},
                   {"type": "message.part.removed", "properties": {"partID": value}},
                   {"type": "message.part.updated", "properties": {"sessionID": value, "part": {
                       "id": "prt_1", "messageID": "msg_1", "type": "tool", "sessionID": value}}},
                   {"type": "question.asked", "properties": {"id": "que_1", "sessionID": S,
                                                              "questions": [{"options": value}]}},
                   {"type": "permission.asked", "properties": {"id": value, "sessionID": S}}):
            bridge.on_event(1, ev)
        bridge.on_line(json.dumps({"type": "answer", "question_id": value, "answers": []}).encode())
    assert all(isinstance(o, dict) for o in out)


def test_a_silent_event_stream_is_a_lost_stream() -> None:
    """No heartbeat within HEARTBEAT_TIMEOUT_S: the reader reports the stream down (v4 gating)."""
    import queue
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
                     b'data: {"type":"server.connected","properties":{}}\n\n')
        threading.Event().wait(3)  # then silence
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    q: queue.Queue[Any] = queue.Queue()
    old = B.HEARTBEAT_TIMEOUT_S
    B.HEARTBEAT_TIMEOUT_S = 0.3
    stream = B.EventStream(srv.getsockname()[1], "Basic x", q)
    try:
        stream.start()
        assert q.get(timeout=5) == ("sse", 1, {"type": "server.connected", "properties": {}})
        kind, gen, why = q.get(timeout=5)
        assert (kind, gen) == ("sse_down", 1) and "timed out" in why
    finally:
        stream.stop()
        B.HEARTBEAT_TIMEOUT_S = old
        srv.close()
