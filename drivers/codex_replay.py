"""Recorded Codex app-server streams: a recording wrapper and a causal replay transport.

A recording is JSONL, one ``{"dir": "send"|"recv", "line": "<raw line>"}`` per wire line in
the order the driver saw them (``send`` = what the driver wrote, ``recv`` = what Codex
printed). The secret header never appears: the transport sends it before any wrapper sees a
line.

:class:`ReplayTransport` replays the ``recv`` lines. A recorded *response* is released only
after the driver under test has really sent the request it answers (same id and method), so
a driver that forgets a request (say, ``turn/interrupt`` on timeout) blocks instead of
passing by accident. Used by tests/unit/test_codex_*.py and tests/bench/bench_codex_driver.py;
recordings are made by tests/cli/test_codex_driver.py (``CODEX_CAPTURE=1``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import anyio

from drivers.transport import Transport, TransportClosed

Entry = tuple[str, bytes]  # ("send" | "recv", raw line)


def load_stream(path: str | Path) -> list[Entry]:
    out: list[Entry] = []
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        if raw.strip():
            rec = json.loads(raw)
            out.append((rec["dir"], rec["line"].encode()))
    return out


def dump_stream(entries: list[Entry], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for direction, line in entries:
            fh.write(json.dumps({"dir": direction, "line": line.decode("utf-8", "replace")}, ensure_ascii=False) + "\n")


def _obj(line: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


class RecordingTransport:
    """Wraps a transport and keeps every line both ways in ``entries``."""

    def __init__(self, inner: Transport, entries: list[Entry] | None = None) -> None:
        self.inner = inner
        self.entries: list[Entry] = entries if entries is not None else []

    async def send(self, line: bytes) -> None:
        self.entries.append(("send", line.rstrip(b"\n")))
        await self.inner.send(line)

    async def receive(self) -> bytes | None:
        line = await self.inner.receive()
        if line is not None:
            self.entries.append(("recv", line))
        return line

    async def close(self) -> None:
        await self.inner.close()

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def diagnostics(self) -> str:
        return self.inner.diagnostics()


class ReplayTransport:
    """Replays recorded ``recv`` lines; see the module docstring for the causality rule.

    ``at_end``: ``"eof"`` ends the stream after the last line (a dead process), ``"hang"``
    keeps it open with nothing more to say (a stalled CLI). ``causal=False`` releases every
    line at once (used for garbled or synthetic streams).
    """

    def __init__(self, entries: list[Entry] | list[bytes], *, at_end: Literal["eof", "hang"] = "eof",
                 causal: bool = True) -> None:
        norm = [e if isinstance(e, tuple) else ("recv", e) for e in entries]
        self._lines = [line for d, line in norm if d == "recv"]
        self._requests: dict[Any, str] = {}  # recorded request id -> method
        for d, line in norm:
            obj = _obj(line) if d == "send" else None
            if obj and isinstance(obj.get("method"), str) and "id" in obj:
                self._requests[json.dumps(obj["id"])] = obj["method"]
        self._at_end = at_end
        self._causal = causal
        self._sent_ids: dict[Any, anyio.Event] = {}
        self.sent: list[bytes] = []
        self.mismatches: list[str] = []
        self.delivered = 0
        self._closed = False

    def _event(self, rid: Any) -> anyio.Event:
        return self._sent_ids.setdefault(json.dumps(rid), anyio.Event())

    async def send(self, line: bytes) -> None:
        if self._closed:
            raise TransportClosed("replay: stdin closed")
        line = line.rstrip(b"\n")
        self.sent.append(line)
        obj = _obj(line)
        if obj and isinstance(obj.get("method"), str) and "id" in obj:
            want = self._requests.get(json.dumps(obj["id"]))
            if want is not None and want != obj["method"]:
                self.mismatches.append(f"id {obj['id']}: sent {obj['method']}, recorded {want}")
            self._event(obj["id"]).set()

    async def receive(self) -> bytes | None:
        if self.delivered >= len(self._lines):
            if self._at_end == "hang":
                await anyio.sleep_forever()
            return None
        line = self._lines[self.delivered]
        obj = _obj(line) if self._causal else None
        if obj and "method" not in obj and json.dumps(obj.get("id")) in self._requests:
            await self._event(obj["id"]).wait()
        self.delivered += 1
        return line

    async def close(self) -> None:
        self._closed = True

    @property
    def alive(self) -> bool:
        return not self._closed and (self._at_end == "hang" or self.delivered < len(self._lines))

    def diagnostics(self) -> str:
        return ""

    def sent_objects(self) -> list[dict[str, Any]]:
        return [o for o in map(_obj, self.sent) if o is not None]
