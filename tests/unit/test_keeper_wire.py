"""Keeper frames and the keeper's output log: both halves of the wire, offsets, ack, replay, bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox_manager import keeper_wire as wire
from tests.support.keeper_script import keeper_script

KINDS = st.sampled_from([b"A", b"I", b"K", b"C", b"Z", b"P", b"H", b"D", b"E", b"X", b"S", b"B", b"R", b"G"])
FRAMES = st.lists(st.tuples(KINDS, st.binary(max_size=300)), max_size=12)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


@given(FRAMES, st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
@settings(max_examples=300)
def test_any_split_decodes_to_the_same_frames_on_both_halves(frames, cuts) -> None:
    ks = keeper_script()
    encoded = b"".join(wire.encode(k, p) for k, p in frames)
    # the two halves encode identically
    assert encoded == b"".join(ks.frame(k, p) for k, p in frames)
    host, sandbox = wire.FrameDecoder(), ks.Decoder()
    got_host, got_sandbox = [], []
    for chunk in split(encoded, cuts):
        got_host += [(f.kind, f.payload) for f in host.feed(chunk)]
        got_sandbox += sandbox.feed(chunk)
    assert got_host == frames and got_sandbox == frames
    assert host.pending == 0


def test_offsets_and_json_frames() -> None:
    ks = keeper_script()
    (f,) = wire.FrameDecoder().feed(wire.encode_data(2**40 + 7, b"abc\n"))
    assert (f.kind, f.offset(), f.data()) == (b"D", 2**40 + 7, b"abc\n")
    (f,) = wire.FrameDecoder().feed(ks.frame(b"E", ks.OFFSET.pack(12)))
    assert (f.kind, f.offset()) == (b"E", 12)
    (f,) = wire.FrameDecoder().feed(ks.json_frame(b"X", {"code": 3, "signal": None}))
    assert f.json() == {"code": 3, "signal": None}
    (f,) = ks.Decoder().feed(wire.attach_frame(41))
    assert f[0] == b"A" and __import__("json").loads(f[1]) == {"protocol": 1, "from": 41}


def test_oversized_length_is_a_frame_error_not_an_allocation() -> None:
    ks = keeper_script()
    bogus = b"D" + (wire.MAX_PAYLOAD + 1).to_bytes(4, "big")
    with pytest.raises(wire.FrameError, match="over the"):
        wire.FrameDecoder().feed(bogus)
    with pytest.raises(ks.FrameError, match="over the"):
        ks.Decoder().feed(bogus)
    with pytest.raises(wire.FrameError, match="over the"):
        wire.encode(wire.INPUT, b"x" * (wire.MAX_PAYLOAD + 1))


def test_bad_payloads_are_named() -> None:
    with pytest.raises(wire.FrameError, match="not JSON"):
        wire.Frame(b"H", b"{nope").json()
    with pytest.raises(wire.FrameError, match="8-byte offset"):
        wire.Frame(b"K", b"\x00\x01").offset()


# -- the keeper's output log --------------------------------------------------------------------


def test_log_keeps_unacked_output_and_replays_from_any_kept_offset() -> None:
    log = keeper_script().OutputLog(limit=100)
    log.append(b"0123456789")
    assert (log.acked, log.written) == (0, 10)
    assert log.read(0, 100) == b"0123456789" and log.read(4, 3) == b"456"
    assert log.ack(6) is None and log.acked == 6
    assert log.read(6, 100) == b"6789"
    assert log.refusal(5) == "offset_released"
    assert log.refusal(6) is None and log.refusal(10) is None
    assert log.refusal(11) == "offset_ahead"
    assert log.ack(4) is None and log.acked == 6  # stale acks are harmless
    assert log.ack(11) == "ack_ahead" and log.acked == 6


def test_log_overflow_marks_it_broken_and_every_attach_is_refused() -> None:
    log = keeper_script().OutputLog(limit=8)
    assert log.append(b"12345678") is False  # exactly the bound is fine
    assert log.append(b"9") is True
    assert log.broken == "more than 8 bytes of output not acknowledged"
    assert log.append(b"more") is False and log.written == 13
    assert log.refusal(0) == log.refusal(13) == "broken"
    assert log.ack(13) is None  # still counted, never replayable again
    assert log.refusal(13) == "broken"


@given(st.lists(st.one_of(st.tuples(st.just("w"), st.binary(min_size=1, max_size=50)),
                          st.tuples(st.just("a"), st.floats(min_value=0, max_value=1)),
                          st.tuples(st.just("r"), st.floats(min_value=0, max_value=1))), max_size=60))
@settings(max_examples=300)
def test_commit_then_reattach_from_acked_reads_every_byte_exactly_once(ops) -> None:
    """A daemon reads, commits (acks) some of it, dies; the next one attaches from the ack."""
    log = keeper_script().OutputLog(limit=1 << 20)
    produced = bytearray()
    committed = bytearray()  # what the daemons committed, in order
    cursor = 0  # the current daemon's read position
    for op, arg in ops:
        if op == "w":
            log.append(arg)
            produced += arg
        elif op == "a":  # read some more, then commit a prefix of what was read
            cursor += int((log.written - cursor) * arg)
            upto = log.acked + int((cursor - log.acked) * arg)
            committed += log.read(log.acked, upto - log.acked)
            assert log.ack(upto) is None
        else:  # the daemon dies: the next one re-attaches from the acknowledged offset
            assert log.refusal(log.acked) is None
            cursor = log.acked
    committed += log.read(log.acked, log.written - log.acked)
    assert bytes(committed) == bytes(produced)
