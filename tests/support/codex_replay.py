"""Recorded Codex app-server streams: a causal replay transport.

Recordings (``send`` = what the driver wrote, ``recv`` = what Codex printed) are made with
:class:`tests.support.replay.RecordingTransport` by tests/cli/test_codex_driver.py
(``CODEX_CAPTURE=1``) and read with :func:`tests.support.replay.load_stream`.

:class:`ReplayTransport` replays the ``recv`` lines. A recorded *response* is released only
after the driver under test has really sent the request it answers (same id and method), so
a driver that forgets a request (say, ``turn/interrupt`` on timeout) blocks instead of
passing by accident. Used by tests/unit/test_codex_*.py and tests/bench/bench_codex_driver.py.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anyio

from drivers.base import parse_json_line
from drivers.transport import MAX_LINE_BYTES
from tests.support.replay import Entry, ReplayBase


class ReplayTransport(ReplayBase):
    """Replays recorded ``recv`` lines; see the module docstring for the causality rule.

    ``at_end``: ``"eof"`` ends the stream after the last line (a dead process), ``"hang"``
    keeps it open with nothing more to say (a stalled CLI). ``causal=False`` releases every
    line at once (used for garbled or synthetic streams).
    """

    def __init__(self, entries: list[Entry] | list[bytes], *, at_end: Literal["eof", "hang"] = "eof",
                 causal: bool = True, max_line: int = MAX_LINE_BYTES) -> None:
        super().__init__(max_line=max_line)
        norm = [e if isinstance(e, tuple) else ("recv", e) for e in entries]
        self._lines = [line for d, line in norm if d == "recv"]
        self._requests: dict[Any, str] = {}  # recorded request id -> method
        for d, line in norm:
            obj = parse_json_line(line) if d == "send" else None
            if obj and isinstance(obj.get("method"), str) and "id" in obj:
                self._requests[json.dumps(obj["id"])] = obj["method"]
        self._at_end = at_end
        self._causal = causal
        self._sent_ids: dict[Any, anyio.Event] = {}
        self.sent: list[bytes] = []
        self.mismatches: list[str] = []
        self.delivered = 0

    def _event(self, rid: Any) -> anyio.Event:
        return self._sent_ids.setdefault(json.dumps(rid), anyio.Event())

    async def send(self, line: bytes) -> None:
        self._check_open()
        line = line.rstrip(b"\n")
        self.sent.append(line)
        obj = parse_json_line(line)
        if obj and isinstance(obj.get("method"), str) and "id" in obj:
            want = self._requests.get(json.dumps(obj["id"]))
            if want is not None and want != obj["method"]:
                self.mismatches.append(f"id {obj['id']}: sent {obj['method']}, recorded {want}")
            self._event(obj["id"]).set()

    async def receive(self) -> bytes | None:
        if self.delivered >= len(self._lines):
            if self._at_end == "hang":
                await anyio.sleep_forever()
            self._end()
            return None
        line = self._checked(self._lines[self.delivered])
        obj = parse_json_line(line) if self._causal else None
        if obj and "method" not in obj and json.dumps(obj.get("id")) in self._requests:
            await self._event(obj["id"]).wait()
        self.delivered += 1
        return line

    @property
    def alive(self) -> bool:
        return super().alive and (self._at_end == "hang" or self.delivered < len(self._lines))

    def sent_objects(self) -> list[dict[str, Any]]:
        return [o for o in map(parse_json_line, self.sent) if o is not None]
