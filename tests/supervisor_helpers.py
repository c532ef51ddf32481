"""Helpers for full-stack tests: a conversation tracker that knows what the model must see."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from deploy.loopback import LoopbackFixture, Message, assert_history, default_reply


def available_runtimes() -> list[str]:
    """Every runtime in the registry, each driver imported. A driver that fails to import is an
    error (at collection, so the whole suite says so), never a skip: a runtime silently dropping
    out would take its identity, LOST and lifecycle cases with it."""
    from drivers.registry import RUNTIMES, get_driver

    for r in RUNTIMES:
        get_driver(r)
    return list(RUNTIMES)


def runtimes_one_per_bridge() -> list[str]:
    """Every runtime but Kilo, for cases about the resident's process and transport (the keeper,
    a killed process group) rather than about the CLI: Kilo is OpenCode's fork behind the same
    bridge (drivers/bridge, http-agent-live-bridge) and the same keeper, so its case repeats
    OpenCode's at twice the cost (its server starts in ~13 s here). Kilo's own behaviour keeps
    its place in the regression matrices (history, identity, loss, volumes, upgrade), the
    lifecycle test and the bridge driver tests."""
    return [r for r in available_runtimes() if r != "kilo"]


@dataclass
class Chat:
    """One member's conversation: builds jobs and the exact history the model must see."""

    runtime: str
    user_id: str = field(default_factory=lambda: f"user-{uuid.uuid4().hex[:8]}")
    chat_id: str = field(default_factory=lambda: f"chat-{uuid.uuid4().hex[:8]}")
    member_id: str = "m1"
    history: list[Message] = field(default_factory=list)

    def job(self, message: str, **extra: Any) -> dict[str, Any]:
        return {"job_id": f"job-{uuid.uuid4().hex}", "user_id": self.user_id, "chat_id": self.chat_id,
                "member_id": self.member_id, "runtime": self.runtime, "message": message, **extra}

    def user_texts(self) -> list[str]:
        return [m.text for m in self.history if m.role == "user"]

    def expect_turn(self, message: str) -> str:
        """Record a successful turn; return the assistant text the fixture will send."""
        self.history.append(Message(role="user", text=message))
        reply = default_reply(self.user_texts())
        self.history.append(Message(role="assistant", text=reply))
        return reply

    def expected_request(self) -> list[Message]:
        """What the model must see in the latest turn's request: everything up to its user message."""
        return self.history[:-1]


def last_conversation(fx: LoopbackFixture, since: int) -> list[Message]:
    reqs = [r for r in fx.requests(kind="conversation") if r.seq > since]
    assert reqs, "the fixture recorded no conversational request for this turn"
    return reqs[-1].conversation()


def assert_model_saw(fx: LoopbackFixture, since: int, chat: Chat) -> None:
    assert_history(chat.expected_request(), last_conversation(fx, since))


def high_water(fx: LoopbackFixture) -> int:
    reqs = fx.requests()
    return reqs[-1].seq if reqs else 0
