"""The bridge's turn logic (images/sandbox/helpers/http-agent-live-bridge) on scripted event
sequences: attribution of assistant text, settlement at native idle, v3/v4 duties."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from images.pins import load_pins
from tests.support.bridge_replay import bridge_module

B = bridge_module()
S, CHILD, OTHER = "ses_root0000000001", "ses_child000000001", "ses_other000000001"


class Server:
    """A scripted OpenCode server: transcript + status map; POSTs are recorded (and can fail)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.status: dict[str, Any] = {}
        self.sessions: dict[str, dict[str, Any]] = {S: {"id": S, "title": "t", "directory": "/w"}}
        self.posts: list[tuple[str, Any]] = []
        self.fail: dict[str, int] = {}  # path regex -> number of calls that fail

    def call(self, method: str, path: str, body: Any = None, timeout: float = 0.0) -> Any:
        for pattern, n in list(self.fail.items()):
            if n and re.search(pattern, path):
                self.fail[pattern] = n - 1
                raise B.HttpError(500, "scripted failure")
        if method == "POST":
            self.posts.append((path, body))
            if path == "/session":
                self.sessions["ses_created00000001"] = {"id": "ses_created00000001", "title": body.get("title")}
                return self.sessions["ses_created00000001"]
            if path.endswith("/fork"):
                return {"id": "ses_fork0000000001"}
            return True if not path.endswith("/prompt_async") else None
        if path == "/session/status":
            return self.status
        if m := re.fullmatch(r"/session/(\w+)/message(\?.*)?", path):
            return [x for x in self.messages if x["info"].get("sessionID", S) == m.group(1)]
        if m := re.fullmatch(r"/session/(\w+)", path):
            if m.group(1) in self.sessions:
                return self.sessions[m.group(1)]
            raise B.HttpError(404, '{"name":"NotFoundError"}')
        raise B.HttpError(404, path)

    def posted(self, suffix: str) -> list[Any]:
        return [body for path, body in self.posts if path.endswith(suffix)]


class Harness:
    def __init__(self, **kw: Any) -> None:
        self.server = Server()
        self.out: list[dict[str, Any]] = []
        self.now = 100.0
        self.cuts = 0
        self.bridge = B.Bridge("opencode", self.server, self.out.append, self, clock=lambda: self.now,
                               sleep=lambda _s: None, **kw)
        self.ids = iter(f"msg_{n:012x}Uuuuuuuuuuuuuu" for n in range(0x22a000000001, 0x22a000000100))
        self.bridge.mint = self  # client-minted ids the test knows in advance
        self.uids: list[str] = []

    # the bridge's stream object / id minter
    def cut(self) -> None:
        self.cuts += 1

    def bump(self, _seen: Any) -> None:
        pass

    def __call__(self) -> str:
        uid = next(self.ids)
        self.uids.append(uid)
        return uid

    # driving
    def ev(self, type_: str, gen: int = 1, **props: Any) -> None:
        self.bridge.on_event(gen, {"type": type_, "properties": props})
        self.bridge.on_tick()

    def cmd(self, **cmd: Any) -> None:
        self.bridge.on_line(json.dumps(cmd).encode())
        self.bridge.on_tick()

    def tick(self, dt: float = 0.0) -> None:
        self.now += dt
        self.bridge.on_tick()

    def start(self, text: str = "hello") -> str:
        self.ev("server.connected")
        self.cmd(type="open", session_id=S)
        self.cmd(type="prompt", turn_id="t1", text=text)
        return self.uids[-1]

    def types(self) -> list[str]:
        return [o["type"] for o in self.out]

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [o for o in self.out if o["type"] == type_]

    def settled(self) -> dict[str, Any]:
        [s] = self.of("settled")
        return s


def user(h: Harness, uid: str, text: str, sid: str = S) -> None:
    h.server.messages.append({"info": {"id": uid, "sessionID": sid, "role": "user"},
                              "parts": [{"id": "prt_u" + uid[-6:], "type": "text", "text": text}]})
    h.ev("message.updated", sessionID=sid, info={"id": uid, "sessionID": sid, "role": "user"})
    h.ev("message.part.updated", sessionID=sid,
         part={"id": "prt_u" + uid[-6:], "messageID": uid, "sessionID": sid, "type": "text", "text": text})


def assistant(h: Harness, mid: str, parent: str, *, completed: bool, text: str | None = None,
              error: dict[str, Any] | None = None, sid: str = S, emit: bool = True) -> None:
    info: dict[str, Any] = {"id": mid, "sessionID": sid, "role": "assistant", "parentID": parent,
                            "time": {"created": 1, **({"completed": 2} if completed else {})}}
    if error:
        info["error"] = error
    parts = [{"id": "prt_a" + mid[-6:], "type": "text", "text": text}] if text is not None else []
    h.server.messages = [m for m in h.server.messages if m["info"]["id"] != mid] + [{"info": info, "parts": parts}]
    if emit:
        h.ev("message.updated", sessionID=sid, info=info)


def idle(h: Harness, sid: str = S) -> None:
    h.ev("session.status", sessionID=sid, status={"type": "idle"})
    h.ev("session.idle", sessionID=sid)


# ---------------------------------------------------------------- basics


def test_version_is_the_pinned_helper_version() -> None:
    assert B.BRIDGE_VERSION == load_pins().helper.version == 4


def test_minted_ids_are_native_format_and_ascending() -> None:
    mint = B.Minter()
    ids = [mint() for _ in range(50)]
    assert all(re.fullmatch(r"msg_[0-9a-f]{12}[0-9A-Za-z]{14}", i) for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == 50
    mint.bump("msg_ffffffffff00" + "A" * 14)  # a stored id from a clock ahead of ours
    nxt = mint()
    assert nxt > "msg_ffffffffff00" + "A" * 14 and re.fullmatch(r"msg_[0-9a-f]{12}[0-9A-Za-z]{14}", nxt)


def test_plain_turn_settles_with_assistant_text_only() -> None:
    h = Harness()
    uid = h.start("secret user words")
    assert h.server.posted("/prompt_async") == [{"messageID": uid, "parts": [{"type": "text", "text": "secret user words"}]}]
    user(h, uid, "secret user words")
    h.ev("session.status", sessionID=S, status={"type": "busy"})
    assistant(h, "msg_a1", uid, completed=False)
    h.ev("message.part.updated", sessionID=S, part={"id": "prt_1", "messageID": "msg_a1", "sessionID": S,
                                                     "type": "text", "text": ""})
    for d in ("Hel", "lo"):
        h.ev("message.part.delta", sessionID=S, messageID="msg_a1", partID="prt_1", field="text", delta=d)
    assistant(h, "msg_a1", uid, completed=True, text="Hello")
    h.ev("message.part.updated", sessionID=S, part={"id": "prt_1", "messageID": "msg_a1", "sessionID": S,
                                                     "type": "text", "text": "Hello"})
    assert not h.of("settled")
    idle(h)
    s = h.settled()
    assert s == {"type": "settled", "turn_id": "t1", "ok": True, "reason": "completed", "session_id": S,
                 "message_id": uid, "text": "Hello"}
    assert "".join(t["delta"] for t in h.of("text")) == "Hello"
    assert "secret user words" not in json.dumps([o for o in h.out if o["type"] != "settled"])
    idle(h)  # duplicate idles after settlement are ignored
    assert len(h.of("settled")) == 1


def test_compaction_of_the_root_session_is_reported_at_settlement() -> None:
    """Native compaction on: the server's session.compacted for S during the turn makes the
    settled line say ``compacted`` (a child session's compaction, or none, says nothing)."""
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    h.ev("session.compacted", sessionID=CHILD)
    assistant(h, "msg_a1", uid, completed=True, text="fine")
    idle(h)
    assert "compacted" not in h.settled()
    h2 = Harness()
    uid = h2.start()
    user(h2, uid, "u")
    h2.ev("session.compacted", sessionID=S)
    assistant(h2, "msg_a1", uid, completed=True, text="after the summary")
    idle(h2)
    assert h2.settled() == {"type": "settled", "turn_id": "t1", "ok": True, "reason": "completed", "session_id": S,
                            "message_id": uid, "text": "after the summary", "compacted": True}


def test_late_metadata_is_resolved_and_synthetic_or_removed_parts_are_dropped() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    # parts before their message's metadata (and a delta before its part)
    h.ev("message.part.delta", sessionID=S, messageID="msg_a1", partID="prt_1", field="text", delta="Ea")
    h.ev("message.part.updated", sessionID=S, part={"id": "prt_1", "messageID": "msg_a1", "type": "text", "text": ""})
    h.ev("message.part.delta", sessionID=S, messageID="msg_a1", partID="prt_1", field="text", delta="rly")
    h.ev("message.part.updated", sessionID=S, part={"id": "prt_s", "messageID": "msg_a1", "type": "text",
                                                     "text": "⠋ Initializing snapshot…", "synthetic": True})
    h.ev("message.part.updated", sessionID=S, part={"id": "prt_r", "messageID": "msg_a1", "type": "text", "text": ""})
    h.ev("message.part.removed", sessionID=S, messageID="msg_a1", partID="prt_r")
    h.ev("message.part.delta", sessionID=S, messageID="msg_a1", partID="prt_r", field="text", delta="gone")
    assert h.of("text") == []
    assistant(h, "msg_a1", uid, completed=False)
    assert [t["delta"] for t in h.of("text")] == ["Early"]
    # a second reply whose metadata never arrives on the stream: resolved from REST at settlement
    h.ev("message.part.updated", sessionID=S, part={"id": "prt_2", "messageID": "msg_a2", "type": "text",
                                                     "text": "Late"})
    assistant(h, "msg_a1", uid, completed=True, text="Early", emit=False)
    assistant(h, "msg_a2", uid, completed=True, text="Late", emit=False)
    idle(h)
    assert [t["delta"] for t in h.of("text")] == ["Early", "Late"]
    assert h.settled()["text"] == "Early\n\nLate"
    assert h.types()[-1] == "settled"


def test_child_session_idle_and_text_do_not_count_for_the_root() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    h.ev("session.created", sessionID=CHILD, info={"id": CHILD, "parentID": S})
    assistant(h, "msg_c1", "msg_childuser", completed=True, text="child text", sid=CHILD)
    h.ev("message.part.updated", sessionID=CHILD, part={"id": "prt_c", "messageID": "msg_c1", "sessionID": CHILD,
                                                         "type": "text", "text": "child text"})
    idle(h, CHILD)
    h.server.status = {S: {"type": "busy"}}
    assert not h.of("settled") and not h.of("text")
    assistant(h, "msg_a1", uid, completed=True, text="root")
    h.server.status = {}
    idle(h)
    assert h.settled()["text"] == "root"


def test_error_idle_before_final_message_and_repeated() -> None:
    """On abort/error the idle precedes the final message.updated, and repeats."""
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    assistant(h, "msg_a1", uid, completed=False)
    err = {"name": "APIError", "data": {"message": "fixture: request rejected", "statusCode": 400}}
    h.ev("session.error", sessionID=S, error=err)
    idle(h)
    assert not h.of("settled")  # REST: the newest reply has no time.completed yet
    assistant(h, "msg_a1", uid, completed=True, error=err)
    s = h.settled()
    assert s["ok"] is False and s["reason"] == "error" and s["text"] == ""
    assert s["error"] == {"name": "APIError", "message": "fixture: request rejected", "status": 400}
    idle(h)
    assert len(h.of("settled")) == 1


def test_idle_before_admission_and_busy_status_do_not_settle() -> None:
    h = Harness()
    uid = h.start()
    assistant(h, "msg_a1", uid, completed=True, text="x", emit=False)
    idle(h)  # not admitted yet (no message.updated for U)
    assert not h.of("settled")
    user(h, uid, "u")
    h.server.status = {S: {"type": "busy"}}
    idle(h)
    assert not h.of("settled")
    h.server.status = {}
    h.tick(0.1)
    assert not h.of("settled")  # the recheck waits RECHECK_S
    h.tick(B.RECHECK_S)
    assert h.settled()["ok"] is True


def test_events_of_earlier_turns_are_dropped() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    assistant(h, "msg_old", "msg_previous_user", completed=False)  # an earlier bridge turn's reply
    h.ev("message.part.updated", sessionID=S, part={"id": "prt_o", "messageID": "msg_old", "type": "text",
                                                     "text": "stale"})
    assistant(h, "msg_a1", uid, completed=True, text="fresh")
    h.ev("message.part.updated", sessionID=S, part={"id": "prt_f", "messageID": "msg_a1", "type": "text",
                                                     "text": "fresh"})
    idle(h)
    assert [t["delta"] for t in h.of("text")] == ["fresh"] and h.settled()["text"] == "fresh"


def test_idle_without_any_reply_settles_after_a_grace() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    idle(h)
    assert not h.of("settled")
    h.tick(B.NO_REPLY_GRACE_S + 0.1)
    s = h.settled()
    assert s["ok"] is False and s["error"]["name"] == "NoReply"


# ---------------------------------------------------------------- permissions, questions, offline


def test_permissions_for_root_and_task_children_only() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    h.ev("permission.asked", id="per_1", sessionID=S, permission="bash", patterns=["echo 1"])
    # a child reported by the root turn's task tool part
    h.ev("message.part.updated", sessionID=S, part={
        "id": "prt_t", "messageID": "msg_a1", "sessionID": S, "type": "tool", "tool": "task", "callID": "c1",
        "state": {"status": "running", "metadata": {"sessionId": CHILD}, "input": {}}})
    h.ev("permission.asked", id="per_2", sessionID=CHILD, permission="bash", patterns=["echo 2"])
    # a grandchild found over REST through its parent chain
    h.server.sessions["ses_grand000000001"] = {"id": "ses_grand000000001", "parentID": CHILD}
    h.ev("permission.asked", id="per_3", sessionID="ses_grand000000001", permission="edit", patterns=["x"])
    # an unrelated session: reported, never answered
    h.server.sessions[OTHER] = {"id": OTHER}
    h.ev("permission.asked", id="per_4", sessionID=OTHER, permission="bash", patterns=["rm"])
    replies = [(p, b) for p, b in h.server.posts if p.startswith("/permission/")]
    assert replies == [("/permission/per_1/reply", {"reply": "once"}), ("/permission/per_2/reply", {"reply": "once"}),
                       ("/permission/per_3/reply", {"reply": "once"})]
    perms = h.of("permission")
    assert [(p["id"], p["ok"], p["reply"]) for p in perms] == [
        ("per_1", True, "once"), ("per_2", True, "once"), ("per_3", True, "once"), ("per_4", None, None)]
    assert h.of("tool")[0]["tool"] == "task" and h.of("tool")[0]["root"] is True


def test_failed_permission_reply_is_retried_then_aborts() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    h.server.fail[r"/permission/per_1/"] = 1
    h.ev("permission.asked", id="per_1", sessionID=S, permission="bash", patterns=[])
    assert h.of("permission")[-1]["attempts"] == 2
    assert h.of("permission")[-1]["ok"] is True and not h.server.posted("/abort")
    h.server.fail[r"/permission/per_2/"] = 99
    h.ev("permission.asked", id="per_2", sessionID=S, permission="bash", patterns=[])
    p = h.of("permission")[-1]
    assert p["ok"] is False and p["attempts"] == 1 + len(B.REPLY_BACKOFF_S)
    assert h.server.posts[-1][0] == f"/session/{S}/abort"
    assistant(h, "msg_a1", uid, completed=True, error={"name": "MessageAbortedError", "data": {"message": "Aborted"}})
    idle(h)
    s = h.settled()
    assert s["ok"] is False and s["reason"] == "permission_failed"


def test_test_seam_fails_permission_replies_without_sending_them() -> None:
    h = Harness(fail_replies=2)
    uid = h.start()
    user(h, uid, "u")
    h.ev("permission.asked", id="per_1", sessionID=S, permission="bash", patterns=[])
    assert h.of("permission")[-1]["attempts"] == 3 and h.of("permission")[-1]["ok"] is True
    assert h.server.posted("/permission/per_1/reply") == [{"reply": "once"}]


def test_question_reply_is_correlated_to_its_id() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    qs = [{"question": "Pick?", "header": "P", "options": [{"label": "A", "description": ""},
                                                           {"label": "B", "description": ""}]},
          {"question": "Free?", "header": "F", "options": []}]
    h.ev("question.asked", id="que_7", sessionID=S, questions=qs)
    assert h.server.posted("/question/que_7/reply") == [{"answers": [["A"], []]}]
    q = h.of("question")[-1]
    assert q["id"] == "que_7" and q["answers"] == [["A"], []] and q["ok"] is True


def test_question_policy_ask_waits_for_the_answer_command() -> None:
    h = Harness(question_policy="ask")
    uid = h.start()
    user(h, uid, "u")
    h.ev("question.asked", id="que_8", sessionID=S, questions=[{"question": "Q", "options": [{"label": "A"}]}])
    assert not h.server.posted("/reply") and h.of("question")[-1]["answers"] is None
    h.cmd(type="answer", question_id="que_9", answers=[["A"]])
    assert h.of("error")[-1]["reason"] == "unknown_question"
    h.cmd(type="answer", question_id="que_8", answers=[["B"]])
    assert h.server.posted("/question/que_8/reply") == [{"answers": [["B"]]}]


def test_kilo_offline_ask_is_rejected_and_ends_the_turn() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    assistant(h, "msg_a1", uid, completed=False)
    h.ev("session.network.asked", id="que_n1", sessionID=S, message="Cannot connect to API")
    assert [p for p, _ in h.server.posts if p.startswith("/network/")] == ["/network/que_n1/reject"]
    err = {"name": "APIError", "data": {"message": "Cannot connect to API"}}
    h.ev("session.error", sessionID=S, error=err)
    assistant(h, "msg_a1", uid, completed=True, error=err)
    h.ev("session.turn.close", sessionID=S, reason="error")
    s = h.settled()
    assert s["ok"] is False and s["reason"] == "offline"


# ---------------------------------------------------------------- v4: the event stream


def test_prompt_waits_for_a_live_stream() -> None:
    h = Harness()
    h.ev("server.connected")
    h.cmd(type="open", session_id=S)
    h.bridge.on_stream_down(1, "test")
    h.cmd(type="prompt", turn_id="t1", text="x")
    assert not h.server.posted("/prompt_async")
    h.ev("message.updated", gen=1, info={"id": "msg_x", "role": "user"})  # a stale generation: ignored
    h.ev("server.connected", gen=2)
    assert len(h.server.posted("/prompt_async")) == 1
    h2 = Harness()
    h2.cmd(type="open", session_id=S)
    h2.cmd(type="prompt", turn_id="t9", text="x")
    h2.tick(B.STREAM_WAIT_S + 1)
    assert h2.of("error")[-1] == {"type": "error", "reason": "stream_lost", "turn_id": "t9",
                                  "detail": "no live event stream to start the turn on"}
    assert not h2.server.posted("/prompt_async")


def test_stream_loss_mid_turn_aborts_and_settles_once_rest_shows_idle() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    assistant(h, "msg_a1", uid, completed=False, text="partial")
    h.server.status = {S: {"type": "busy"}}
    h.bridge.on_stream_down(1, "cut")
    assert h.server.posts[-1][0] == f"/session/{S}/abort"
    h.tick(1)
    assert not h.of("settled")
    h.server.status = {}
    assistant(h, "msg_a1", uid, completed=True, text="partial", emit=False,
              error={"name": "MessageAbortedError", "data": {"message": "Aborted"}})
    h.tick(1)
    s = h.settled()
    assert s["ok"] is False and s["reason"] == "stream_lost" and s["text"] == "partial"


def test_stream_loss_without_rest_proof_is_reported_as_lost_transport() -> None:
    h = Harness()
    uid = h.start()
    user(h, uid, "u")
    h.server.status = {S: {"type": "busy"}}
    h.bridge.on_stream_down(1, "cut")
    for _ in range(int(B.LOSS_CONFIRM_S) + 2):
        h.tick(1)
    assert not h.of("settled")
    err = h.of("error")[-1]
    assert err["reason"] == "stream_lost" and err["turn_id"] == "t1"
    assert h.bridge.turn is None
    # a loss with REST idle but no reply at all is no proof either (the turn may not have started)
    h2 = Harness()
    uid2 = h2.start()
    user(h2, uid2, "u")
    h2.bridge.on_stream_down(1, "cut")
    for _ in range(int(B.LOSS_CONFIRM_S) + 2):
        h2.tick(1)
    assert h2.of("error")[-1]["reason"] == "stream_lost" and not h2.of("settled")


def test_cut_stream_is_a_test_seam_only() -> None:
    h = Harness()
    h.cmd(type="_cut_stream")
    assert h.cuts == 0 and h.of("error")[-1]["reason"] == "unknown_command"
    h2 = Harness(test_seams=True)
    h2.cmd(type="_cut_stream")
    assert h2.cuts == 1 and not h2.of("error")


# ---------------------------------------------------------------- commands and bad input


@pytest.mark.parametrize("line,reason", [
    (b"not json", "bad_command"), (b"[1,2]", "bad_command"), (b'"x"', "bad_command"), (b"\xff\xfe", "bad_command"),
    (b'{"type":"dance"}', "unknown_command"), (b'{"no":"type"}', "unknown_command"),
    (b'{"type":"prompt","turn_id":1,"text":"x"}', "bad_command"), (b'{"type":"prompt","turn_id":"a"}', "bad_command"),
    (b'{"type":"abort"}', "no_turn"), (b'{"type":"answer"}', "unknown_question"),
    (b'{"type":"fork","message_id":"../x"}', "bad_command"),
])
def test_bad_input_gets_an_error_and_the_bridge_keeps_running(line: bytes, reason: str) -> None:
    h = Harness()
    h.ev("server.connected")
    h.cmd(type="open", session_id=S)
    h.bridge.on_line(line)
    assert h.of("error")[-1]["reason"] == reason
    h.cmd(type="prompt", turn_id="t1", text="still alive")
    assert len(h.server.posted("/prompt_async")) == 1


def test_prompt_rules() -> None:
    h = Harness()
    h.ev("server.connected")
    h.cmd(type="prompt", turn_id="t0", text="x")
    assert h.of("error")[-1] == {"type": "error", "reason": "no_session", "detail": "send open first", "turn_id": "t0"}
    h.cmd(type="open", session_id=S)
    h.cmd(type="prompt", turn_id="t1", text="x")
    h.cmd(type="prompt", turn_id="t2", text="y")
    assert h.of("error")[-1]["reason"] == "busy" and h.of("error")[-1]["turn_id"] == "t2"
    h.cmd(type="open", session_id=S)
    assert h.of("error")[-1]["reason"] == "busy"
    # the native session still busy from something else: refused, not queued behind it
    h2 = Harness()
    h2.ev("server.connected")
    h2.cmd(type="open", session_id=S)
    h2.server.status = {S: {"type": "busy"}}
    h2.cmd(type="prompt", turn_id="t1", text="x")
    assert h2.of("error")[-1]["reason"] == "prompt_rejected" and not h2.server.posted("/prompt_async")


def test_open_create_lookup_and_not_found() -> None:
    h = Harness()
    h.cmd(type="open", title="My chat", permission=[{"permission": "bash", "pattern": "*", "action": "ask"}])
    assert h.server.posted("/session") == [{"title": "My chat", "permission": [
        {"permission": "bash", "pattern": "*", "action": "ask"}]}]
    assert h.of("opened")[-1]["created"] is True and h.of("opened")[-1]["session_id"] == "ses_created00000001"
    h.cmd(type="open", session_id=S)
    assert h.of("opened")[-1] == {"type": "opened", "session_id": S, "created": False, "title": "t",
                                  "directory": "/w", "parent_id": None}
    h.cmd(type="open", session_id="ses_missing0000001")
    assert h.of("error")[-1]["reason"] == "not_found"
    h.cmd(type="open", session_id="ses_../../etc")
    assert h.of("error")[-1]["reason"] == "not_found"
    h.cmd(type="open")
    assert h.server.posted("/session")[-1] == {"title": B.DEFAULT_TITLE}


def test_fork_and_abort_and_close() -> None:
    h = Harness()
    uid = h.start()
    h.cmd(type="fork")
    assert h.of("error")[-1]["reason"] == "busy"
    h.cmd(type="abort")
    assert h.server.posted("/abort") == [None]
    user(h, uid, "u")
    assistant(h, "msg_a1", uid, completed=True, error={"name": "MessageAbortedError", "data": {"message": "Aborted"}})
    idle(h)
    assert h.settled()["reason"] == "aborted"
    h.cmd(type="fork", message_id=uid)
    assert h.server.posted("/fork") == [{"messageID": uid}]
    assert h.of("forked")[-1] == {"type": "forked", "session_id": "ses_fork0000000001", "from_session_id": S,
                                  "message_id": uid}
    h.cmd(type="close")
    assert h.bridge.closing and h.types()[-1] == "closed"


def test_status_is_checked_before_a_prompt_unless_the_last_turn_settled_idle() -> None:
    h = Harness()
    uid = h.start()
    assert [p for p, *_ in h.server.posts] == [f"/session/{S}/prompt_async"]
    user(h, uid, "u")
    assistant(h, "msg_a1", uid, completed=True, text="a")
    idle(h)
    calls: list[str] = []
    real = h.server.call
    h.server.call = lambda m, p, b=None, timeout=0.0: (calls.append(p), real(m, p, b))[1]  # type: ignore[method-assign]
    h.cmd(type="prompt", turn_id="t2", text="next")
    assert calls == [f"/session/{S}/prompt_async"]  # verified idle: no extra status round trip
    uid2 = h.uids[-1]
    user(h, uid2, "u2")
    assistant(h, "msg_a2", uid2, completed=True, text="b")
    idle(h)
    h.ev("session.status", sessionID=S, status={"type": "busy"})  # work we did not start
    calls.clear()
    h.server.status = {S: {"type": "busy"}}
    h.cmd(type="prompt", turn_id="t3", text="again")
    assert calls == ["/session/status"] and h.of("error")[-1]["reason"] == "prompt_rejected"


def test_parallel_settlement_reads() -> None:
    """The real bridge reads /session/status and the transcript at once."""
    h = Harness(parallel=True)
    uid = h.start()
    user(h, uid, "u")
    assistant(h, "msg_a1", uid, completed=True, text="a")
    h.server.fail[r"^/session/status$"] = 1
    h.ev("session.idle", sessionID=S)
    assert not h.of("settled")  # a failed read is no proof
    h.tick(B.RECHECK_S)
    assert h.settled()["text"] == "a"
