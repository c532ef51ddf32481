"""Demultiplexing the engine's attached-exec framing, and the launch spec's argv/secret rules."""

from __future__ import annotations


import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from drivers.launch import HeaderCheck, LaunchSpec
from sandbox_manager.exec_stream import ExecStream

pytestmark = pytest.mark.anyio


def frame(kind: int, payload: bytes) -> bytes:
    return bytes([kind, 0, 0, 0]) + len(payload).to_bytes(4, "big") + payload


class FakeSocket:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)
        self.sent: list[bytes] = []
        self.eof_sent = False

    async def receive(self, n: int = 65536) -> bytes:
        if not self.chunks:
            raise anyio.EndOfStream
        return self.chunks.pop(0)

    async def send(self, data: bytes) -> None:
        self.sent.append(data)

    async def send_eof(self) -> None:
        self.eof_sent = True

    async def aclose(self) -> None:
        pass


async def collect(stream: ExecStream) -> list[bytes]:
    out = []
    while (line := await stream.receive()) is not None:
        out.append(line)
    return out


async def test_demux_stdout_lines_and_keep_stderr() -> None:
    raw = frame(1, b'{"a":1}\n{"b"') + frame(2, b"warning: x\n") + frame(1, b":2}\npartial")
    # split the raw bytes at awkward places, including inside a frame header
    chunks = [raw[:3], raw[3:11], raw[11:30], raw[30:]]
    s = ExecStream(FakeSocket(chunks), "exec-1")  # type: ignore[arg-type]
    assert await collect(s) == [b'{"a":1}', b'{"b":2}', b"partial"]
    assert s.diagnostics() == "warning: x\n"


@given(st.lists(st.binary(max_size=40), max_size=8), st.integers(min_value=1, max_value=13))
def test_demux_any_split(payloads, cut) -> None:
    raw = b"".join(frame(1, p) for p in payloads)
    chunks = [raw[i:i + cut] for i in range(0, len(raw), cut)]
    s = ExecStream(FakeSocket(chunks), "e")  # type: ignore[arg-type]
    lines = anyio.run(collect, s)
    *complete, tail = b"".join(payloads).split(b"\n")
    expected = [e[:-1] if e.endswith(b"\r") else e for e in complete] + ([tail] if tail else [])
    assert lines == expected  # CRLF is trimmed on complete lines; a trailing fragment comes back as is


async def test_send_appends_newline_and_close_is_half_close() -> None:
    sock = FakeSocket([])
    s = ExecStream(sock, "e")  # type: ignore[arg-type]
    await s.send(b"x")
    await s.close()
    assert sock.sent == [b"x\n"] and sock.eof_sent and not s.alive


def test_launcher_argv_carries_prechecks_and_no_secret_channel() -> None:
    # SPEC 7: nothing secret is delivered to a sandbox; the stdin secret header is gone
    spec = LaunchSpec(runtime="codex", argv=["codex-native", "app-server"], cwd="/w", env={"HOME": "/h"},
                      require_files=["/h/f"], require_header=HeaderCheck(path="/h/s.jsonl", key="id", value="abc"))
    argv = spec.launcher_argv(pidfile="/run/p.pid")
    assert argv == ["ca-launch", "--pidfile", "/run/p.pid", "--cwd", "/w",
                    "--require-file", "/h/f", "--require-header", "/h/s.jsonl", "id", "abc", "--",
                    "codex-native", "app-server"]
    with pytest.raises(ValueError, match="secret_env"):
        LaunchSpec(runtime="codex", argv=["x"], cwd="/w", secret_env={"KEY": "sk"})
