"""A member CLI's line stream through its in-sandbox keeper (SPEC section 14).

The keeper (``ca-keeper`` in the image) owns the CLI's stdio and numbers its stdout by
byte offset. :class:`KeeperChannel` speaks the keeper's frames over any byte stream (the
attached exec: ``sandbox_manager.keeper_bytes.ExecBytes``; the host's link to its socket:
``sandbox_manager.keeper_link.SocketBytes``; a local process in tests:
``tests.support.keeper_local.ProcessBytes``) and gives the driver the same line stream a
``Transport`` gives: ``send`` / ``receive`` / ``close`` / ``alive`` / ``diagnostics``. On top
it knows where it is in the CLI's output (:attr:`KeeperChannel.offset`), acknowledges what
the runner has committed (:meth:`KeeperChannel.ack`; the keeper keeps everything after that
offset), and who it talks to (:attr:`KeeperChannel.hello`): a channel opened with an expected
:class:`KeeperIdentity` refuses any other keeper before reading a byte of its output.

Errors are one family under :class:`KeeperError` (``sandbox_manager.keeper_errors``); what
the keeper says about itself is ``sandbox_manager.keeper_identity``.
"""

from __future__ import annotations

from collections import deque

import anyio
from pydantic import ValidationError

from sandbox_manager import keeper_wire as wire
from sandbox_manager.exec_stream import ExecStreamClosed
from sandbox_manager.keeper_bytes import ByteStream
from sandbox_manager.keeper_errors import (
    KeeperBroken,
    KeeperDetached,
    KeeperError,
    KeeperLineTooLong,
    KeeperProtocolError,
    KeeperRefused,
    KeeperUnavailable,
)
from sandbox_manager.keeper_identity import KeeperExit, KeeperHello, KeeperIdentity

MAX_LINE_BYTES = 32 * 1024 * 1024
STDERR_KEEP = 16 * 1024


# -- the channel ----------------------------------------------------------------------------------


class KeeperChannel:
    """The driver-facing line stream of a CLI under a keeper, plus offsets and identity."""

    def __init__(self, stream: ByteStream, hello: KeeperHello, from_offset: int, *,
                 auto_ack_bytes: int | None = None, max_line: int = MAX_LINE_BYTES) -> None:
        self.stream = stream
        self.hello = hello
        self.auto_ack_bytes = auto_ack_bytes
        self.max_line = max_line  # bound on one output line (memory, and a runaway CLI)
        self.exit: KeeperExit | None = hello.exit
        self.broken_reason: str | None = hello.broken_reason
        self.goodbye: str | None = None
        self._decoder = wire.FrameDecoder()
        self._lines = bytearray()
        self._offset = from_offset  # CLI output handed out by receive()
        self._received = from_offset  # CLI output received from the keeper
        self._acked = from_offset
        self.input_sent = hello.input_received  # CLI input bytes the keeper has (had) from us
        self._eof = False
        self._ended = False
        self._stdin_closed = False
        self._failure: KeeperError | None = None
        self._line_too_long: KeeperLineTooLong | None = None
        self._stderr: deque[bytes] = deque()
        self._stderr_len = 0
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._note = b""  # a turn note's frame, sent with the next input (note_with_input)

    @classmethod
    async def open(cls, stream: ByteStream, *, from_offset: int = 0, expect: KeeperIdentity | None = None,
                   timeout_s: float = 30.0,
                   auto_ack_bytes: int | None = None, max_line: int = MAX_LINE_BYTES) -> KeeperChannel:
        """Attach over ``stream`` (a fresh ``ca-keeper run`` or ``ca-keeper attach``).

        Reads from ``from_offset`` (the last acknowledged one). ``expect`` is the recorded
        identity: any other keeper raises :class:`KeeperIdentityMismatch` before anything
        of its output is read or acknowledged.
        """
        try:
            request = wire.attach_frame(from_offset, expect.model_dump() if expect is not None else None)
            try:
                await stream.send_bytes(request)
            except ExecStreamClosed as exc:
                raise KeeperUnavailable(f"the keeper client's stdin is gone: {exc}") from exc
            with anyio.move_on_after(timeout_s) as scope:
                hello, rest, decoder = await _await_hello(stream)
            if scope.cancelled_caught:
                raise KeeperUnavailable(f"no hello from the keeper within {timeout_s} s ({stream.diagnostics()})")
            if expect is not None:
                expect.verify(hello)
            if hello.protocol != wire.PROTOCOL:
                raise KeeperProtocolError(f"keeper speaks protocol {hello.protocol}, not {wire.PROTOCOL}")
            if not hello.accepted:
                if hello.refused == "broken":
                    raise KeeperBroken(f"the keeper is broken: {hello.broken_reason}")
                raise KeeperRefused(f"the keeper refused to attach from {from_offset}: {hello.refused} "
                                    f"(acked {hello.acked}, written {hello.written})",
                                    reason=hello.refused or "refused")
            channel = cls(stream, hello, from_offset, auto_ack_bytes=auto_ack_bytes, max_line=max_line)
            channel._decoder = decoder  # it may hold the start of the next frame
            for frame in rest:
                channel._apply(frame)
            if from_offset > hello.acked:  # committed by a daemon that died before it acknowledged
                await channel._send(wire.encode_offset(wire.ACK, from_offset))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return channel

    # -- Transport protocol --------------------------------------------------------------------

    async def send(self, line: bytes) -> None:
        if self._stdin_closed:
            raise KeeperError("stdin already closed", reason="stdin_closed")
        if self._failure is not None or self._ended:
            raise self._failure or KeeperDetached("the attach stream has ended")
        data = _with_newline(line)
        frames = b"".join(wire.encode(wire.INPUT, data[i:i + wire.MAX_PAYLOAD])
                          for i in range(0, len(data), wire.MAX_PAYLOAD))
        note, self._note = self._note, b""
        try:
            await self._send(note + frames if note else frames)
        except KeeperDetached as exc:
            if note:
                self._failure = exc  # the note went nowhere: no input may follow without it
            raise
        self.input_sent += len(data)

    async def receive(self) -> bytes | None:
        while True:
            if self._line_too_long is not None:
                raise self._line_too_long
            idx = self._lines.find(b"\n")
            if idx > self.max_line or (idx < 0 and len(self._lines) > self.max_line):
                self._line_too_long = KeeperLineTooLong(f"line longer than {self.max_line} bytes")
                raise self._line_too_long
            if idx >= 0:
                line = bytes(self._lines[:idx])
                del self._lines[: idx + 1]
                self._offset += idx + 1
                if self._ack_due():
                    with anyio.CancelScope(shield=True):  # the line is out of the buffer: never lose it
                        await self._auto_ack()
                return line[:-1] if line.endswith(b"\r") else line
            if self._eof:
                if self._lines:
                    line = bytes(self._lines)
                    self._offset += len(line)
                    self._lines.clear()
                    return line
                return None
            if self._failure is not None:
                raise self._failure
            await self._read()

    async def close(self) -> None:
        """The CLI's stdin EOF (through the keeper); its output can still be read."""
        if self._stdin_closed:
            return
        self._stdin_closed = True
        if self._failure is None and not self._ended:
            with anyio.CancelScope(shield=True):
                try:
                    await self._send(wire.encode(wire.CLOSE_STDIN))
                except KeeperError:
                    pass

    @property
    def alive(self) -> bool:
        return (not self._eof and not self._stdin_closed and not self._ended and self._failure is None
                and self._line_too_long is None and self.exit is None)

    def diagnostics(self) -> str:
        text = b"".join(self._stderr).decode(errors="replace")
        extra = self.stream.diagnostics()
        return f"{text}{extra}" if extra else text

    # -- offsets and lifetime ----------------------------------------------------------------------

    @property
    def identity(self) -> KeeperIdentity:
        return KeeperIdentity.of(self.hello)

    @property
    def offset(self) -> int:
        """Bytes of the CLI's output handed out by :meth:`receive` (a line boundary)."""
        return self._offset

    @property
    def acked(self) -> int:
        return self._acked

    @property
    def broken(self) -> bool:
        return self.broken_reason is not None

    @property
    def eof(self) -> bool:
        return self._eof

    async def ack(self, offset: int | None = None) -> None:
        """Let the keeper release output before ``offset`` (default: all handed out so far).

        Acknowledge only what is committed: a re-attach can start no earlier.
        """
        upto = self._offset if offset is None else offset
        if upto > self._offset:
            raise ValueError(f"ack {upto} is beyond the {self._offset} bytes handed out")
        if upto <= self._acked:
            return
        self._acked = upto
        await self._send(wire.encode_offset(wire.ACK, upto))

    @property
    def takes_notes(self) -> bool:
        """The keeper keeps a turn note (an image before them does not)."""
        return self.hello.turn_notes

    def note_with_input(self, note: str) -> None:
        """The keeper's turn note from the next input on (every later hello gives it): it goes
        in front of that input, in the same write. The keeper handles frames in order, so it has
        the note whenever it has the input, and a turn wakes it once, not twice. A note not sent
        yet is replaced by the next one; none goes out with anything but an input."""
        if not self.takes_notes:
            raise KeeperError("this keeper keeps no turn note", reason="no_turn_notes")
        if self._failure is not None or self._ended:
            raise self._failure or KeeperDetached("the attach stream has ended")
        data = note.encode()
        if len(data) > wire.MAX_PAYLOAD:
            raise ValueError(f"a turn note of {len(data)} bytes is over the frame's {wire.MAX_PAYLOAD}")
        self._note = wire.encode(wire.NOTE, data)

    async def skip_to(self, offset: int, timeout_s: float = 10.0) -> None:
        """Read and drop the CLI's output up to ``offset``, a line boundary the previous daemon
        had read to (a turn's note names where its turn began; an attach starts at the last
        acknowledged offset, which may be earlier)."""
        with anyio.move_on_after(timeout_s) as scope:
            while self._offset < offset:
                if await self.receive() is None:
                    break
        if self._offset != offset:
            waited = f" within {timeout_s} s" if scope.cancelled_caught else ""
            raise KeeperUnavailable(f"the output read to {self._offset}, not to the turn's start at {offset}{waited}")

    async def wait_exit(self, timeout_s: float = 5.0) -> KeeperExit | None:
        """After the CLI's EOF: read on until its exit status arrives (or the link ends)."""
        with anyio.move_on_after(timeout_s):
            while self.exit is None and not self._ended and self._failure is None:
                await self._read()
        return self.exit

    async def detach(self) -> None:
        """End this attach only; the keeper and the CLI live on (daemon shutdown)."""
        self._ended = True
        await self.stream.aclose()

    aclose = detach

    async def shutdown(self, grace_s: float = 2.0) -> KeeperExit | None:
        """Retire through the keeper: it ends the CLI's process group (TERM, ``grace_s``,
        KILL) and exits. Returns the CLI's exit status when the keeper reported it."""
        try:
            if self._failure is None and not self._ended:
                await self._send(wire.encode_json(wire.SHUTDOWN, {"grace_s": grace_s}))
                with anyio.move_on_after(grace_s + 5.0):
                    while not self._ended and self._failure is None:
                        await self._read()
        except KeeperError:
            pass
        finally:
            await self.detach()
        return self.exit

    # -- frames -----------------------------------------------------------------------------------

    async def _send(self, data: bytes) -> None:
        async with self._send_lock:
            try:
                await self.stream.send_bytes(data)
            except ExecStreamClosed as exc:
                raise KeeperDetached(f"the keeper link is gone: {exc}") from exc

    def _ack_due(self) -> bool:
        return self.auto_ack_bytes is not None and self._offset - self._acked >= self.auto_ack_bytes

    async def _auto_ack(self) -> None:
        try:
            await self.ack()
        except KeeperDetached:
            pass  # the next receive reports the end

    async def _read(self) -> None:
        chunk = await self.stream.receive_bytes()
        if not chunk:
            self._ended = True
            if self.goodbye in ("finished", "shutdown") or self.exit is not None and self._eof:
                self._eof = True  # the keeper ended the CLI (or delivered all of it): end of stream
            elif self._failure is None:
                # a cut inside a frame is a detach too: whole frames only were applied
                self._failure = KeeperDetached(
                    f"the keeper link ended at offset {self._received} before the CLI's output did "
                    f"({self._decoder.pending} bytes of a frame cut off; {self.stream.diagnostics() or 'no detail'})")
            return
        try:
            frames = self._decoder.feed(chunk)
        except wire.FrameError as exc:
            self._failure = KeeperProtocolError(str(exc))
            return
        for frame in frames:
            self._apply(frame)

    def _apply(self, frame: wire.Frame) -> None:
        """Take one frame in; a failure is kept, to be raised once the lines before it are out."""
        if self._failure is not None:
            return
        kind = frame.kind
        try:
            if kind == wire.DATA:
                at = frame.offset()
                if at != self._received:
                    raise KeeperProtocolError(f"output at offset {at}, expected {self._received}: bytes lost or "
                                              "repeated")
                data = frame.data()
                self._lines += data
                self._received += len(data)
            elif kind == wire.EOF:
                at = frame.offset()
                if at != self._received:
                    raise KeeperProtocolError(f"EOF at offset {at}, but {self._received} bytes were received")
                self._eof = True
            elif kind == wire.EXIT:
                self.exit = KeeperExit.model_validate(frame.json())
            elif kind == wire.STDERR:
                self._keep_stderr(frame.payload)
            elif kind == wire.BROKEN:
                detail = frame.json()
                self.broken_reason = str(detail.get("detail") or detail.get("reason"))
                self._failure = KeeperBroken(f"the keeper is broken: {self.broken_reason}")
            elif kind == wire.REFUSED:
                detail = frame.json()
                self._failure = KeeperRefused(f"the keeper refused: {detail.get('detail', '')}",
                                              reason=str(detail.get("reason", "refused")))
            elif kind == wire.GOODBYE:
                self.goodbye = str(frame.json().get("reason"))
                if self.goodbye == "superseded":
                    self._failure = KeeperDetached("a newer attach took this keeper over", reason="superseded")
            else:
                raise KeeperProtocolError(f"unexpected frame {kind!r} from the keeper")
        except (wire.FrameError, ValidationError) as exc:
            self._failure = KeeperProtocolError(f"bad {kind!r} frame: {exc}")
        except KeeperProtocolError as exc:
            self._failure = exc

    def _keep_stderr(self, data: bytes) -> None:
        self._stderr.append(data)
        self._stderr_len += len(data)
        while self._stderr_len > STDERR_KEEP and len(self._stderr) > 1:
            self._stderr_len -= len(self._stderr.popleft())


async def _await_hello(stream: ByteStream) -> tuple[KeeperHello, list[wire.Frame], wire.FrameDecoder]:
    """Read up to the hello; return it and the frames after it (not applied: not trusted yet)."""
    decoder = wire.FrameDecoder()
    while True:
        chunk = await stream.receive_bytes()
        if not chunk:
            detail = stream.diagnostics()
            raise KeeperUnavailable(f"the keeper client ended before a hello{': ' + detail if detail else ''}")
        try:
            frames = decoder.feed(chunk)
        except wire.FrameError as exc:
            raise KeeperProtocolError(f"not keeper frames: {exc} ({stream.diagnostics()})") from exc
        for i, frame in enumerate(frames):
            if frame.kind == wire.HELLO:
                try:
                    hello = KeeperHello.model_validate(frame.json())
                except (wire.FrameError, ValidationError) as exc:
                    raise KeeperProtocolError(f"bad hello: {exc}") from exc
                return hello, frames[i + 1:], decoder
            if frame.kind == wire.REFUSED:
                detail = frame.json()
                reason = str(detail.get("reason", "refused"))
                cls = KeeperUnavailable if reason in ("no_keeper", "keeper_start_failed") else KeeperRefused
                raise cls(f"{reason}: {detail.get('detail', '')}", reason=reason)
            raise KeeperProtocolError(f"frame {frame.kind!r} before the keeper's hello")


def _with_newline(line: bytes) -> bytes:
    return line if line.endswith(b"\n") else line + b"\n"
