"""Recorded wire streams of the real CLIs: the recording transport and the file format.

A recording is JSONL, one ``{"dir": <direction>, "line": "<raw line>"}`` per wire line in
the order the driver saw them. The two directions are named by each CLI's recordings:
``send``/``recv`` for Codex and Claude (what the driver wrote / what the CLI printed),
``in``/``out`` for pi. The secret header never appears: ``LocalProcessTransport.start``
sends it before any wrapper sees a line.

The CLI-specific replay transports: :mod:`tests.support.codex_replay` (request-matching
replay), :mod:`tests.support.pi_replay` (scripted ``get_state`` answers),
:mod:`tests.support.claude_replay` (order-matching replay). Each keeps the transport contract
(drivers/transport.py) through :class:`ReplayBase`, so a driver meets the same errors in a
replay as over a real stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from drivers.transport import MAX_LINE_BYTES, LineTooLong, Transport, TransportClosed, TransportWrapper

Entry = tuple[str, bytes]  # (direction, raw line without its newline)
SEND_RECV = ("send", "recv")


def read_jsonl(path: str | Path) -> list[Any]:
    """Every non-blank line of a JSONL file, parsed."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(records: list[Any], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def load_stream(path: str | Path) -> list[Entry]:
    return [(rec["dir"], rec["line"].encode()) for rec in read_jsonl(path)]


def dump_stream(entries: list[Entry], path: str | Path, *, errors: str = "replace") -> None:
    """Write a recording; ``errors`` is how a line that is not UTF-8 is decoded ("strict" raises)."""
    write_jsonl([{"dir": d, "line": line.decode("utf-8", errors)} for d, line in entries], path)


class RecordingTransport(TransportWrapper):
    """Wraps a transport and appends every line both ways to ``entries`` (a caller's list, or
    a new one), as ``(directions[0], sent line)`` and ``(directions[1], received line)``."""

    def __init__(self, inner: Transport, entries: list[Entry] | None = None, *,
                 directions: tuple[str, str] = SEND_RECV) -> None:
        super().__init__(inner)
        self.entries: list[Entry] = entries if entries is not None else []
        self.directions = directions

    async def send(self, line: bytes) -> None:
        self.entries.append((self.directions[0], line.rstrip(b"\n")))
        await self.inner.send(line)

    async def receive(self) -> bytes | None:
        line = await self.inner.receive()
        if line is not None:
            self.entries.append((self.directions[1], line))
        return line


class ReplayBase:
    """The contract part every replay transport shares: ``close()`` makes ``send`` raise
    :class:`TransportClosed`; a recorded line over ``max_line`` raises :class:`LineTooLong`;
    once the script is over (``None`` returned) or broken, ``alive`` is false."""

    def __init__(self, *, max_line: int = MAX_LINE_BYTES) -> None:
        self.max_line = max_line
        self._closed = False
        self._ended = False
        self._broken = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("replay: stdin already closed")

    def _checked(self, line: bytes) -> bytes:
        if self._broken or len(line) > self.max_line:
            self._broken = True
            raise LineTooLong(f"replay: line longer than {self.max_line} bytes")
        return line

    def _end(self) -> None:
        self._ended = True

    async def close(self) -> None:
        self._closed = True

    @property
    def alive(self) -> bool:
        return not (self._closed or self._ended or self._broken)

    def diagnostics(self) -> str:
        return ""
