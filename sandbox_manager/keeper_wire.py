"""The keeper's frames, host side: encode and decode only (no Docker, no I/O).

Both directions carry frames of ``kind:1 byte, length:4 bytes big-endian, payload``
(``images/sandbox/helpers/ca-keeper`` holds the in-sandbox half and the full table).
Everything the daemon sends is framed, so CLI input (JSON lines) can never be mistaken for
an acknowledgement or a control request, and a client that dies mid-frame delivers no
partial line to the CLI: the keeper hands an input frame on only once it is whole.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

PROTOCOL = 1
HEADER = struct.Struct(">cI")
OFFSET = struct.Struct(">Q")
MAX_PAYLOAD = 16 * 1024 * 1024

# daemon -> keeper
ATTACH = b"A"  # {"protocol": 1, "from": N[, "expect": identity]}: the first frame of a connection
STATUS = b"P"  # instead of ATTACH: hello + stderr, then close; the attached client is untouched
INPUT = b"I"  # bytes for the CLI's stdin
ACK = b"K"  # 8-byte offset: the keeper may release output before it
CLOSE_STDIN = b"C"
SHUTDOWN = b"Z"  # {"grace_s": S}: end the CLI's process group, then the keeper exits
NOTE = b"T"  # the turn note (UTF-8, opaque to the keeper; empty clears it): every hello gives it back
# keeper -> daemon
HELLO = b"H"  # identity and offsets (JSON)
DATA = b"D"  # 8-byte offset of the first byte + CLI stdout bytes
EOF = b"E"  # 8-byte offset: the CLI's stdout ended there
EXIT = b"X"  # {"code": int | null, "signal": int | null}
STDERR = b"S"  # CLI stderr bytes (the ring's snapshot on attach, then live)
BROKEN = b"B"  # {"reason", "detail"}: the output bound overflowed; the member must retire
REFUSED = b"R"  # {"reason", "detail"}, then the connection ends
GOODBYE = b"G"  # {"reason": superseded | finished | shutdown | status}, then the connection ends


class FrameError(ValueError):
    """Bytes that are not keeper frames (a protocol violation, never CLI output)."""


@dataclass(frozen=True)
class Frame:
    kind: bytes
    payload: bytes

    def json(self) -> dict[str, Any]:
        try:
            obj = json.loads(self.payload)
        except ValueError as exc:
            raise FrameError(f"{self.kind!r} frame is not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise FrameError(f"{self.kind!r} frame is not a JSON object")
        return obj

    def offset(self) -> int:
        if len(self.payload) < OFFSET.size:
            raise FrameError(f"{self.kind!r} frame without its 8-byte offset")
        return OFFSET.unpack_from(self.payload)[0]

    def data(self) -> bytes:
        return self.payload[OFFSET.size:]


def encode(kind: bytes, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"payload of {len(payload)} bytes is over the {MAX_PAYLOAD} limit")
    return HEADER.pack(kind, len(payload)) + payload


def encode_json(kind: bytes, obj: dict[str, Any]) -> bytes:
    return encode(kind, json.dumps(obj, separators=(",", ":")).encode())


def encode_offset(kind: bytes, offset: int) -> bytes:
    return encode(kind, OFFSET.pack(offset))


def encode_data(offset: int, data: bytes) -> bytes:
    return encode(DATA, OFFSET.pack(offset) + data)


def attach_frame(from_offset: int, expect: dict[str, Any] | None = None) -> bytes:
    """``expect``: the identity the attach is for (keeper_id, pid, start_time, member, tags). A
    keeper that is not it refuses (``identity_mismatch``) before it supersedes its client: a
    wrong attach — a path that leads to another member's keeper — takes nothing from that
    member. A keeper from before this field ignores it; the hello's check still refuses."""
    request: dict[str, Any] = {"protocol": PROTOCOL, "from": from_offset}
    if expect is not None:
        request["expect"] = expect
    return encode_json(ATTACH, request)


class FrameDecoder:
    """Turns a byte stream split anywhere back into whole frames."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()
        self._max = max_payload

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos = 0
        while len(buf) - pos >= HEADER.size:
            kind, size = HEADER.unpack_from(buf, pos)
            if size > self._max:
                raise FrameError(f"frame {kind!r} of {size} bytes is over the {self._max} limit")
            end = pos + HEADER.size + size
            if end > len(buf):
                break
            frames.append(Frame(kind, bytes(buf[pos + HEADER.size:end])))
            pos = end
        if pos:
            del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)
