"""The exec stream's raw-bytes side (what the keeper's frames ride on)."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_manager import keeper_wire as wire
from sandbox_manager.exec_stream import ExecStream, ExecStreamClosed
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_bytes import ExecBytes

pytestmark = pytest.mark.anyio


def mux(kind: int, payload: bytes) -> bytes:
    return bytes([kind, 0, 0, 0]) + len(payload).to_bytes(4, "big") + payload


class FakeSocket:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)
        self.sent: list[bytes] = []

    async def receive(self, n: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()
        if not self.chunks:
            raise anyio.EndOfStream
        return self.chunks.pop(0)

    async def send(self, data: bytes) -> None:
        self.sent.append(data)

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.binary(min_size=1, max_size=30)), max_size=10),
       st.integers(min_value=1, max_value=17))
@settings(max_examples=100, deadline=None)
async def test_receive_raw_is_stdout_bytes_exactly(frames, step) -> None:
    raw = b"".join(mux(k, p) for k, p in frames)
    s = ExecStream(FakeSocket([raw[i:i + step] for i in range(0, len(raw), step)]), "e")  # type: ignore[arg-type]
    got = bytearray()
    while chunk := await s.receive_raw():
        got += chunk
    assert bytes(got) == b"".join(p for k, p in frames if k == 1)
    assert s.diagnostics() == b"".join(p for k, p in frames if k == 2).decode(errors="replace")[-16384:]


async def test_send_raw_adds_nothing_and_refuses_after_close() -> None:
    sock = FakeSocket([])
    s = ExecStream(sock, "e")  # type: ignore[arg-type]
    await s.send_raw(b"\x00\x01no newline")
    assert sock.sent == [b"\x00\x01no newline"]
    await s.close()
    with pytest.raises(ExecStreamClosed, match="stdin already closed"):
        await s.send_raw(b"x")


async def test_a_keeper_channel_over_an_exec_stream() -> None:
    hello = wire.encode_json(wire.HELLO, {
        "protocol": 1, "keeper_id": "a" * 32, "keeper_pid": 2, "pid": 3, "start_time": 4, "member": "m",
        "tags": {}, "acked": 0, "written": 6, "eof_at": None, "exit": None, "broken": False, "broken_reason": None,
        "buffer_bytes": 100, "input_received": 0, "input_written": 0, "accepted": True, "refused": None})
    keeper_bytes = hello + wire.encode_data(0, b"hello\n")
    sock = FakeSocket([mux(1, keeper_bytes[:7]), mux(2, b"relay warning\n"), mux(1, keeper_bytes[7:])])
    ch = await KeeperChannel.open(ExecBytes(ExecStream(sock, "e")))  # type: ignore[arg-type]
    assert await ch.receive() == b"hello" and ch.offset == 6
    assert "relay warning" in ch.diagnostics()
    assert sock.sent == [wire.attach_frame(0)]
