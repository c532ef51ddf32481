"""The host's link to a keeper's socket as a byte stream (sandbox_manager.keeper_link.SocketBytes):
a transport of the event loop's own, with the contract anyio's socket stream kept before."""

from __future__ import annotations

import socket

import anyio
import pytest

from sandbox_manager import keeper_link
from sandbox_manager.exec_stream import ExecStreamClosed
from sandbox_manager.keeper_link import SocketBytes

pytestmark = pytest.mark.anyio


async def linked() -> tuple[SocketBytes, socket.socket]:
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    return await SocketBytes.of(ours), peer


async def test_a_read_takes_everything_that_arrived_in_order() -> None:
    link, peer = await linked()
    peer.sendall(b"one\n")
    peer.sendall(b"two\n")
    peer.sendall(b"three\n")
    with anyio.fail_after(5):
        got = b""
        while len(got) < 14:
            got += await link.receive_bytes()
    assert got == b"one\ntwo\nthree\n"
    await link.send_bytes(b"input\n")
    with anyio.fail_after(5):
        await anyio.wait_readable(peer)
    assert peer.recv(100) == b"input\n"
    await link.aclose()
    peer.close()


async def test_the_peers_close_is_an_empty_read_after_what_it_sent() -> None:
    link, peer = await linked()
    peer.sendall(b"last words\n")
    peer.close()
    with anyio.fail_after(5):
        assert await link.receive_bytes() == b"last words\n"
        assert await link.receive_bytes() == b""
        assert await link.receive_bytes() == b""
    with pytest.raises(ExecStreamClosed):
        await link.send_bytes(b"late\n")
    await link.aclose()


async def test_closing_wakes_a_read_in_flight_and_refuses_sends() -> None:
    link, peer = await linked()
    ended: list[bytes] = []

    async def read() -> None:
        ended.append(await link.receive_bytes())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.05)
            assert ended == []
            await link.aclose()
    assert ended == [b""]
    with pytest.raises(ExecStreamClosed):
        await link.send_bytes(b"x")
    peer.close()


async def test_after_a_close_nothing_more_is_read_even_what_had_arrived() -> None:
    link, peer = await linked()
    peer.sendall(b"arrived\n")
    await anyio.sleep(0.1)  # read by the loop, not yet taken
    assert link._link.chunks == [b"arrived\n"]
    await link.aclose()
    assert await link.receive_bytes() == b""
    peer.close()


async def test_a_second_reader_is_refused_and_the_first_still_gets_the_end() -> None:
    """A retire waits for the CLI's exit beside the turn's read: the turn's read must still end
    when the link does (it hung, woken no more, when the second read took its place)."""
    link, peer = await linked()
    first: list[bytes] = []

    async def read() -> None:
        first.append(await link.receive_bytes())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.05)
            with pytest.raises(anyio.BusyResourceError):
                await link.receive_bytes()
            peer.close()
    assert first == [b""]
    await link.aclose()


async def test_a_send_to_a_peer_that_stopped_reading_waits_and_a_close_ends_it() -> None:
    link, peer = await linked()
    outcome: list[str] = []

    async def flood() -> None:
        try:
            for _ in range(10_000):  # far more than the socket's and the transport's buffers
                await link.send_bytes(b"x" * 65536)
            outcome.append("all sent")
        except ExecStreamClosed:
            outcome.append("closed")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(flood)
            await anyio.sleep(0.3)
            assert outcome == []  # waiting for the peer to read
            await link.aclose()
    assert outcome == ["closed"]
    peer.close()


async def test_a_reader_that_falls_behind_pauses_the_socket_and_loses_nothing(monkeypatch) -> None:
    monkeypatch.setattr(keeper_link, "HIGH_WATER", 4096)
    link, peer = await linked()
    sent = bytes(range(256)) * 4096  # 1 MiB: more than the high water mark and the socket's buffers
    peer.setblocking(True)
    got = b""
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, peer.sendall, sent)
            await anyio.sleep(0.2)  # nothing is taken meanwhile: the socket is no longer read
            assert link._link.reading_paused
            assert 4096 < link._link.buffered < len(sent) // 2
            while len(got) < len(sent):
                got += await link.receive_bytes()
    assert got == sent
    assert not link._link.reading_paused
    await link.aclose()
    peer.close()
