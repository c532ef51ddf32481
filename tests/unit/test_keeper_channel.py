"""KeeperChannel over an in-memory byte stream: lines, offsets, acks, identity, every ending."""

from __future__ import annotations

import json
from collections import deque

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_manager import keeper_wire as wire
from sandbox_manager.exec_stream import ExecStreamClosed
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_errors import (
    KeeperBroken,
    KeeperDetached,
    KeeperError,
    KeeperIdentityMismatch,
    KeeperProtocolError,
    KeeperRefused,
    KeeperUnavailable,
)
from sandbox_manager.keeper_identity import KeeperIdentity

pytestmark = pytest.mark.anyio


def hello(**over) -> bytes:
    h = {"protocol": 1, "keeper_id": "k" * 32, "keeper_pid": 10, "pid": 11, "start_time": 12345, "member": "m1",
         "tags": {"locator": "L"}, "acked": 0, "written": 0, "eof_at": None, "exit": None, "broken": False,
         "broken_reason": None, "buffer_bytes": 1 << 26, "input_received": 0, "input_written": 0,
         "accepted": True, "refused": None}
    h.update(over)
    return wire.encode_json(wire.HELLO, h)


IDENT = KeeperIdentity(keeper_id="k" * 32, pid=11, start_time=12345, member="m1", tags={"locator": "L"})


class FakeBytes:
    """Hands out ``chunks`` then end of stream; records what the channel sends."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = deque(chunks)
        self.sent = bytearray()
        self.writes = 0
        self.closed = False

    async def send_bytes(self, data: bytes) -> None:
        if self.closed:
            raise ExecStreamClosed("closed")
        self.sent += data
        self.writes += 1

    async def receive_bytes(self) -> bytes:
        await anyio.lowlevel.checkpoint()
        return self.chunks.popleft() if self.chunks else b""

    async def aclose(self) -> None:
        self.closed = True

    def diagnostics(self) -> str:
        return ""

    def frames(self) -> list[tuple[bytes, bytes]]:
        return [(f.kind, f.payload) for f in wire.FrameDecoder().feed(bytes(self.sent))]


def chop(data: bytes, cuts: list[int]) -> list[bytes]:
    pts = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *pts], [*pts, len(data)], strict=True) if b > a]


async def drain(ch: KeeperChannel) -> list[tuple[bytes, int]]:
    out = []
    while (line := await ch.receive()) is not None:
        out.append((line, ch.offset))
    return out


@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")), min_size=1,
                max_size=12),
       st.integers(min_value=0, max_value=50), st.lists(st.integers(min_value=0, max_value=5000), max_size=15),
       st.lists(st.integers(min_value=1, max_value=30), max_size=5))
@settings(max_examples=100, deadline=None)
async def test_any_split_of_frames_yields_exact_lines_and_offsets(lines, start, cuts, sizes) -> None:
    output = b"".join(line + b"\n" for line in lines)
    # the keeper frames output in pieces of any size, starting at the attach offset
    frames, pos, i = bytearray(), 0, 0
    while pos < len(output):
        n = sizes[i % len(sizes)] if sizes else len(output)
        frames += wire.encode_data(start + pos, output[pos:pos + n])
        pos, i = pos + n, i + 1
    frames += wire.encode(wire.STDERR, b"warn\n")
    frames += wire.encode_offset(wire.EOF, start + len(output)) + wire.encode_json(wire.EXIT, {"code": 0, "signal": None})
    stream = FakeBytes(chop(hello(acked=start, written=start + len(output)) + bytes(frames), cuts))
    ch = await KeeperChannel.open(stream, from_offset=start, expect=IDENT)  # type: ignore[arg-type]
    got = await drain(ch)
    want, off = [], start
    for line in lines:
        off += len(line) + 1
        want.append((line, off))
    assert got == want
    assert await ch.wait_exit() is not None
    assert ch.exit is not None and ch.exit.code == 0 and not ch.alive
    assert ch.diagnostics() == "warn\n"
    # the attach names the keeper it is for: another one refuses it without superseding its client
    assert stream.frames() == [(b"A", json.dumps({"protocol": 1, "from": start, "expect": IDENT.model_dump()},
                                                separators=(",", ":")).encode())]


async def test_partial_last_line_at_eof_counts_in_the_offset() -> None:
    stream = FakeBytes([hello() + wire.encode_data(0, b"a\nbc") + wire.encode_offset(wire.EOF, 4)])
    ch = await KeeperChannel.open(stream)  # type: ignore[arg-type]
    assert await drain(ch) == [(b"a", 2), (b"bc", 4)]


async def test_send_close_ack_are_frames_and_input_is_counted() -> None:
    stream = FakeBytes([hello() + wire.encode_data(0, b'{"a":1}\n{"b":2}\n')])
    ch = await KeeperChannel.open(stream)  # type: ignore[arg-type]
    await ch.send(b'{"op":"x"}')
    assert await ch.receive() == b'{"a":1}' and ch.offset == 8
    await ch.ack()
    await ch.ack()  # nothing new: no second frame
    with pytest.raises(ValueError, match="beyond the 8 bytes handed out"):
        await ch.ack(9)
    await ch.close()
    await ch.close()
    with pytest.raises(KeeperError, match="stdin already closed"):
        await ch.send(b"late")
    assert stream.frames() == [
        (b"A", b'{"protocol":1,"from":0}'), (b"I", b'{"op":"x"}\n'),
        (b"K", (8).to_bytes(8, "big")), (b"C", b""),
    ]
    assert ch.input_sent == len(b'{"op":"x"}\n')
    assert ch.acked == 8


async def test_reattach_past_the_keepers_ack_acknowledges_what_the_store_committed() -> None:
    stream = FakeBytes([hello(acked=10, written=30)])
    ch = await KeeperChannel.open(stream, from_offset=20, expect=IDENT)  # type: ignore[arg-type]
    attach = json.dumps({"protocol": 1, "from": 20, "expect": IDENT.model_dump()}, separators=(",", ":")).encode()
    assert stream.frames() == [(b"A", attach), (b"K", (20).to_bytes(8, "big"))]
    assert ch.offset == ch.acked == 20


@pytest.mark.parametrize(("field", "over"), [
    ("keeper_id", {"keeper_id": "f" * 32}), ("pid", {"pid": 99}), ("start_time", {"start_time": 1}),
    ("member", {"member": "m2"}), ("tags", {"tags": {"locator": "other"}}),
])
async def test_another_identity_is_refused_before_anything_is_read_or_acked(field, over) -> None:
    stream = FakeBytes([hello(acked=0, written=5, **over) + wire.encode_data(0, b"evil\n")])
    with pytest.raises(KeeperIdentityMismatch) as err:
        await KeeperChannel.open(stream, from_offset=3, expect=IDENT)  # type: ignore[arg-type]
    assert err.value.field == field and err.value.reason == "identity_mismatch"
    assert f"keeper identity mismatch on {field}" in str(err.value)
    assert stream.closed
    assert [k for k, _ in stream.frames()] == [b"A"]  # no ack reached an untrusted keeper


async def test_refusals_and_a_broken_keeper_are_named() -> None:
    s = FakeBytes([hello(accepted=False, refused="offset_released", acked=50, written=60)])
    with pytest.raises(KeeperRefused, match="offset_released") as err:
        await KeeperChannel.open(s, from_offset=10)  # type: ignore[arg-type]
    assert err.value.reason == "offset_released" and s.closed
    s = FakeBytes([hello(accepted=False, refused="broken", broken=True, broken_reason="more than 8 bytes")])
    with pytest.raises(KeeperBroken, match="more than 8 bytes"):
        await KeeperChannel.open(s)  # type: ignore[arg-type]
    s = FakeBytes([wire.encode_json(wire.REFUSED, {"reason": "no_keeper", "detail": "nothing answers on /x"})])
    with pytest.raises(KeeperUnavailable, match="nothing answers on /x"):
        await KeeperChannel.open(s)  # type: ignore[arg-type]
    with pytest.raises(KeeperUnavailable, match="ended before a hello"):
        await KeeperChannel.open(FakeBytes([]))  # type: ignore[arg-type]
    with pytest.raises(KeeperProtocolError, match="before the keeper's hello"):
        await KeeperChannel.open(FakeBytes([wire.encode_data(0, b"x\n")]))  # type: ignore[arg-type]
    with pytest.raises(KeeperProtocolError, match="bad hello"):
        await KeeperChannel.open(FakeBytes([wire.encode_json(wire.HELLO, {"protocol": 1})]))  # type: ignore[arg-type]


async def test_no_hello_in_time_is_unavailable() -> None:
    class Silent(FakeBytes):
        async def receive_bytes(self) -> bytes:
            await anyio.sleep_forever()
            return b""

    with pytest.raises(KeeperUnavailable, match="no hello from the keeper within 0.05 s"):
        await KeeperChannel.open(Silent([]), timeout_s=0.05)  # type: ignore[arg-type]


async def test_stream_end_before_eof_is_a_detach_not_the_clis_end() -> None:
    # cut inside a data frame: the whole frames before it count, the cut one does not
    data = wire.encode_data(0, b"one\n") + wire.encode_data(4, b"two\n")
    ch = await KeeperChannel.open(FakeBytes([hello() + data[:-2]]))  # type: ignore[arg-type]
    assert await ch.receive() == b"one"
    with pytest.raises(KeeperDetached, match="ended at offset 4") as err:
        await ch.receive()
    assert isinstance(err.value, ExecStreamClosed)  # one error family with the exec stream
    assert ch.offset == 4 and not ch.alive


async def test_superseded_broken_and_gaps_end_the_stream_with_their_reason() -> None:
    ch = await KeeperChannel.open(FakeBytes([hello() + wire.encode_data(0, b"a\n")
                                             + wire.encode_json(wire.GOODBYE, {"reason": "superseded"})]))  # type: ignore[arg-type]
    assert await ch.receive() == b"a"
    with pytest.raises(KeeperDetached, match="newer attach") as err:
        await ch.receive()
    assert err.value.reason == "superseded"

    ch = await KeeperChannel.open(FakeBytes([hello() + wire.encode_data(0, b"a\nb")
                                             + wire.encode_json(wire.BROKEN, {"reason": "buffer_overflow",
                                                                              "detail": "more than 8 bytes"})]))  # type: ignore[arg-type]
    assert await ch.receive() == b"a"
    with pytest.raises(KeeperBroken, match="more than 8 bytes"):
        await ch.receive()
    assert ch.broken

    ch = await KeeperChannel.open(FakeBytes([hello() + wire.encode_data(0, b"a\n") + wire.encode_data(1, b"b\n")]))  # type: ignore[arg-type]
    assert await ch.receive() == b"a"  # what came whole before the gap is real output
    with pytest.raises(KeeperProtocolError, match="offset 1, expected 2: bytes lost or repeated"):
        await ch.receive()

    ch = await KeeperChannel.open(FakeBytes([hello() + wire.encode_data(0, b"a\n") + wire.encode_offset(wire.EOF, 9)]))  # type: ignore[arg-type]
    assert await ch.receive() == b"a"
    with pytest.raises(KeeperProtocolError, match="EOF at offset 9"):
        await ch.receive()


async def test_shutdown_goodbye_ends_the_stream_cleanly_with_the_exit() -> None:
    stream = FakeBytes([hello() + wire.encode_data(0, b"a\n"),
                        wire.encode_json(wire.EXIT, {"code": None, "signal": 15})
                        + wire.encode_json(wire.GOODBYE, {"reason": "shutdown"})])
    ch = await KeeperChannel.open(stream)  # type: ignore[arg-type]
    exit_ = await ch.shutdown(grace_s=1.0)
    assert exit_ is not None and exit_.signal == 15 and exit_.code is None
    assert stream.frames()[-1] == (b"Z", b'{"grace_s":1.0}') and stream.closed


async def test_auto_ack_acknowledges_in_steps() -> None:
    stream = FakeBytes([hello() + wire.encode_data(0, b"aaaa\nbbbb\ncccc\n")])
    ch = await KeeperChannel.open(stream, auto_ack_bytes=10)  # type: ignore[arg-type]
    for _ in range(3):
        await ch.receive()
    assert [(k, int.from_bytes(p, "big")) for k, p in stream.frames() if k == b"K"] == [(b"K", 10)]
