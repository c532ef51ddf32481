"""The byte streams a :class:`~sandbox_manager.keeper.KeeperChannel` speaks the keeper's frames
over: the contract, and an attached exec of ``ca-keeper run|attach`` (the host's own link to
the keeper's socket is ``sandbox_manager.keeper_link.SocketBytes``)."""

from __future__ import annotations

from typing import Protocol

from sandbox_manager.exec_stream import ExecStream


class ByteStream(Protocol):
    async def send_bytes(self, data: bytes) -> None: ...
    async def receive_bytes(self) -> bytes: ...  # b"" at end of stream
    async def aclose(self) -> None: ...
    def diagnostics(self) -> str: ...


class ExecBytes:
    """An attached exec (of ``ca-keeper run|attach``) as a byte stream."""

    def __init__(self, stream: ExecStream) -> None:
        self.exec = stream

    async def send_bytes(self, data: bytes) -> None:
        await self.exec.send_raw(data)

    async def receive_bytes(self) -> bytes:
        return await self.exec.receive_raw()

    async def aclose(self) -> None:
        await self.exec.aclose()

    def diagnostics(self) -> str:
        return self.exec.diagnostics()
