"""The drivers' :class:`~drivers.transport.Transport` over a sandbox exec stream.

``sandbox_manager`` (Docker only) and ``drivers`` (CLI protocols only) never import each other,
so the runner, which composes them, conforms the exec stream to the transport contract here:
its errors become the drivers' family, once, for every driver (drivers/transport.py explains
the choice). Without it an ``ExecStreamClosed`` escaped the drivers' error mapping: a turn
whose CLI died was never ``NotSettled(transport_closed)`` and its job stayed ``running``.
"""

from __future__ import annotations

from drivers.transport import LineTooLong, TransportClosed
from sandbox_manager.exec_stream import ExecLineTooLong, ExecStream, ExecStreamClosed


class ExecTransport:
    """An :class:`ExecStream` that raises :class:`TransportClosed` / :class:`LineTooLong`."""

    def __init__(self, stream: ExecStream) -> None:
        self.stream = stream

    async def send(self, line: bytes) -> None:
        try:
            await self.stream.send(line)
        except ExecStreamClosed as exc:
            raise TransportClosed(str(exc)) from exc

    async def receive(self) -> bytes | None:
        try:
            return await self.stream.receive()
        except ExecLineTooLong as exc:
            raise LineTooLong(str(exc)) from exc
        except ExecStreamClosed as exc:
            raise TransportClosed(str(exc)) from exc

    async def close(self) -> None:
        await self.stream.close()

    async def aclose(self) -> None:
        """Close the socket itself (after the process group was killed)."""
        await self.stream.aclose()

    @property
    def alive(self) -> bool:
        return self.stream.alive

    def diagnostics(self) -> str:
        return self.stream.diagnostics()


def exec_transport(stream: ExecStream) -> ExecTransport:
    return ExecTransport(stream)
