"""Recorded pi RPC streams: a scripted replay transport.

A recording (:mod:`tests.support.replay`, directions :data:`PI_DIRECTIONS`) holds, in the order the
driver saw them, ``out`` = a line pi printed and ``in`` = a command the driver sent.
:class:`ScriptedPiTransport` replays the ``out`` lines and, at each ``in`` entry, waits
until the driver under test really sends a command of that type (its id replaces the
recorded one in the matching response). A driver that forgets a barrier therefore hangs
(the test times out) instead of passing by accident, and a driver that settles too early
is caught because the recorded follow-on events are still ahead of it.

Used by tests/unit/test_pi_*.py and tests/bench/bench_pi_driver.py; tests/data/pi/capture.py
records real streams with :class:`tests.support.replay.RecordingTransport`.
"""

from __future__ import annotations

import json
from typing import Any

import anyio

from drivers.base import parse_json_line
from drivers.transport import MAX_LINE_BYTES
from tests.support.replay import Entry, ReplayBase

PI_DIRECTIONS = ("in", "out")  # (sent to pi, printed by pi)

DEFAULT_STATE: dict[str, Any] = {
    "isStreaming": False, "isCompacting": False, "messageCount": 0, "pendingMessageCount": 0,
    "sessionId": "01a229fc-0000-7000-8000-000000000000", "sessionFile": "/tmp/pi/sessions/replay.jsonl",
}


class ScriptedPiTransport(ReplayBase):
    """Replays a recording (or plain ``out`` lines) to a driver.

    ``auto_state``: answer every ``get_state`` at once with this state (recorded
    ``get_state`` answers are then dropped) — for hand-made or garbled streams that carry no
    ``in`` entries. At the end of the script the stream ends (EOF) unless ``hold_open``.
    """

    def __init__(self, entries: list[Entry] | list[bytes], *, auto_state: dict[str, Any] | None = None,
                 hold_open: bool = False, max_line: int = MAX_LINE_BYTES) -> None:
        super().__init__(max_line=max_line)
        self.entries: list[Entry] = [e if isinstance(e, tuple) else ("out", e) for e in entries]
        self.auto_state = auto_state
        self.hold_open = hold_open
        self.sent: list[dict[str, Any]] = []
        self.sent_after: list[int] = []  # how many out lines had been delivered when each command was sent
        self.delivered: list[bytes] = []
        self._pending: list[dict[str, Any]] = []
        self._inject: list[bytes] = []
        self._idmap: dict[str, Any] = {}
        self._pos = 0
        self._wake = anyio.Event()

    async def send(self, line: bytes) -> None:
        self._check_open()
        obj = parse_json_line(line)
        if obj is None:
            raise ValueError(f"driver sent a non-JSON line: {line[:200]!r}")
        self.sent.append(obj)
        self.sent_after.append(len(self.delivered))
        if self.auto_state is not None and obj.get("type") == "get_state":
            self._inject.append(json.dumps({"id": obj.get("id"), "type": "response", "command": "get_state",
                                            "success": True, "data": self.auto_state}).encode())
        else:
            self._pending.append(obj)
        self._wake.set()

    async def receive(self) -> bytes | None:
        while True:
            if self._inject:
                return self._deliver(self._inject.pop(0))
            if self._pos >= len(self.entries):
                if self.hold_open and not self._closed:
                    await self._wait()
                    continue
                self._end()
                return None
            direction, line = self.entries[self._pos]
            if direction == "in":
                want = (parse_json_line(line) or {}).get("type")
                cmd = next((c for c in self._pending if c.get("type") == want), None)
                if cmd is None:
                    await self._wait()
                    continue
                self._pending.remove(cmd)
                rec_id = (parse_json_line(line) or {}).get("id")
                if rec_id is not None:
                    self._idmap[rec_id] = cmd.get("id")
                self._pos += 1
                continue
            self._pos += 1
            obj = parse_json_line(line)
            if obj is not None and obj.get("type") == "response" and isinstance(obj.get("id"), (str, int, type(None))):
                if self.auto_state is not None and obj.get("command") == "get_state":
                    continue
                if self.auto_state is not None and obj.get("command") == "prompt" and obj.get("id") not in self._idmap:
                    prompts = [c.get("id") for c in self.sent if c.get("type") == "prompt"]
                    if prompts:  # line mode has no `in` entries: answer the driver's latest prompt
                        self._idmap[obj.get("id")] = prompts[-1]
                if obj.get("id") in self._idmap:
                    obj = {**obj, "id": self._idmap[obj.get("id")]}
                    line = json.dumps(obj, ensure_ascii=False).encode()
            return self._deliver(line)

    def _deliver(self, line: bytes) -> bytes:
        self.delivered.append(self._checked(line))
        return line

    async def _wait(self) -> None:
        self._wake = anyio.Event()
        await self._wake.wait()

    async def close(self) -> None:
        await super().close()
        self._wake.set()

    def commands(self, ctype: str) -> list[dict[str, Any]]:
        return [c for c in self.sent if c.get("type") == ctype]
