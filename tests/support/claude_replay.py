"""Recorded Claude Code stream-json streams (tests/data/claude/): an order-matching replay.

Recordings are made by ``CLAUDE_CAPTURE=1 pytest tests/cli/test_claude_driver.py -k capture``.
A recorded ``send`` step holds the replay until the driver has sent its next line, so lines
arrive in the order the real CLI produced them; request ids of recorded control responses are
rewritten to the ids the driver really used.
"""

from __future__ import annotations

import json
from typing import Any

import anyio

from drivers.transport import MAX_LINE_BYTES
from tests.support.replay import ReplayBase

Step = tuple[str, Any]  # ("send", obj) | ("recv", obj or raw bytes)


class ScriptedTransport(ReplayBase):
    """Replays recorded CLI lines (see the module docstring)."""

    def __init__(self, steps: list[Step], *, hold_open: bool = False, max_line: int = MAX_LINE_BYTES) -> None:
        super().__init__(max_line=max_line)
        self.hold_open = hold_open  # after the last line: stay open (a live idle CLI), not EOF
        self.steps = list(steps)
        self.pos = 0
        self.sent: list[dict[str, Any]] = []
        self.matched = 0  # driver sends matched against recorded send steps
        self.ids: dict[str, str] = {}
        self._wake = anyio.Event()
        self.received = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @closed.setter
    def closed(self, value: bool) -> None:  # tests simulate a launcher that already exited
        self._closed = value

    async def send(self, line: bytes) -> None:
        self._check_open()
        self.sent.append(json.loads(line))
        self._wake.set()

    async def receive(self) -> bytes | None:
        while self.pos < len(self.steps):
            direction, item = self.steps[self.pos]
            if direction == "send":
                while self.matched >= len(self.sent):
                    self._wake = anyio.Event()
                    await self._wake.wait()
                actual = self.sent[self.matched]
                if isinstance(item, dict) and "request_id" in item and "request_id" in actual:
                    self.ids[item["request_id"]] = actual["request_id"]
                self.matched += 1
                self.pos += 1
                continue
            self.pos += 1
            self.received += 1
            if isinstance(item, bytes):
                return self._checked(item)
            obj = item
            resp = obj.get("response") if obj.get("type") == "control_response" else None
            if isinstance(resp, dict) and resp.get("request_id") in self.ids:
                obj = {**obj, "response": {**resp, "request_id": self.ids[resp["request_id"]]}}
            return self._checked(json.dumps(obj, ensure_ascii=False).encode())
        if self.hold_open:
            await anyio.sleep_forever()
        self._end()
        return None

    @property
    def alive(self) -> bool:
        return super().alive and (self.hold_open or self.pos < len(self.steps))

    def sent_subtypes(self) -> list[str]:
        return [o["request"]["subtype"] for o in self.sent if o.get("type") == "control_request"]
