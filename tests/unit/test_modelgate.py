"""ca-modelgate (images/sandbox/helpers/), run as a process on the host against a real unix
socket: each connection is handed over as a descriptor (the server then talks to the client's
own TCP connection: byte-for-byte both ways, half-close), many connections at once, the
connection outlives the gate, a socket that is absent for a while, and the bounded wait when
it never comes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

GATE = Path(__file__).resolve().parents[2] / "images" / "sandbox" / "helpers" / "ca-modelgate"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EchoServer:
    """A unix socket server that takes each handed-over TCP connection, checks what came with
    it, echoes on it and half-closes after the peer's EOF."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(128)
        self.accepted = 0
        self.handoffs: list[tuple[bytes, int, int, int]] = []  # (byte, descriptors, family, type)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                data, fds, _, _ = socket.recv_fds(conn, 16, 4)
            tcp = socket.socket(fileno=fds[0])
            tcp.setblocking(True)  # the gate's copy was non-blocking (one open file, shared flags)
            for extra in fds[1:]:
                os.close(extra)
            self.handoffs.append((data, len(fds), tcp.family, tcp.type))
            threading.Thread(target=self._echo, args=(tcp,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)
            conn.sendall(b"<eof seen>")
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:  # ENOTCONN: the client already has everything and is gone
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[tuple[int, Path, subprocess.Popen]]:
    port, path = free_port(), tmp_path / "model.sock"
    proc = subprocess.Popen([sys.executable, str(GATE), "--socket", str(path), "--listen", f"127.0.0.1:{port}",
                             "--connect-timeout", "3"], stderr=subprocess.PIPE, text=True)
    assert "modelgate.listening" in proc.stderr.readline()  # type: ignore[union-attr]
    yield port, path, proc
    proc.terminate()
    assert proc.wait(10) == 0  # SIGTERM is a clean exit


def exchange(port: int, payload: bytes, *, timeout: float = 20) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)), daemon=True).start()
        out = bytearray()
        while chunk := s.recv(65536):
            out += chunk
        return bytes(out)


def test_bytes_both_ways_and_half_close(gate: tuple[int, Path, subprocess.Popen]) -> None:
    port, path, _ = gate
    server = EchoServer(path)
    try:
        payload = os.urandom(3 << 20) + bytes(range(256))  # not text, larger than any buffer
        assert exchange(port, payload) == payload + b"<eof seen>"
        # the echo server only answers "<eof seen>" after our half-close reached it, and we could
        # still read after closing our side
    finally:
        server.close()
    # one byte and exactly one descriptor: the client's own TCP stream socket
    assert server.handoffs == [(b"F", 1, socket.AF_INET, socket.SOCK_STREAM)]


def test_a_handed_over_connection_outlives_the_gate(gate: tuple[int, Path, subprocess.Popen]) -> None:
    """The gate is in no request's path: once handed over, the connection is the server's."""
    port, path, proc = gate
    server = EchoServer(path)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"before")
            assert s.recv(100) == b"before"
            proc.terminate()
            assert proc.wait(10) == 0
            s.sendall(b"after the gate exited")
            assert s.recv(100) == b"after the gate exited"
    finally:
        server.close()


def test_many_connections_at_once(gate: tuple[int, Path, subprocess.Popen]) -> None:
    port, path, _ = gate
    server = EchoServer(path)
    results: dict[int, bytes] = {}
    payloads = {i: os.urandom(64 * 1024) + str(i).encode() for i in range(40)}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, exchange(port, payloads[i])))
               for i in payloads]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.close()
    assert {i: r == payloads[i] + b"<eof seen>" for i, r in results.items()} == {i: True for i in payloads}
    assert server.accepted == 40


def test_a_connection_waits_for_a_socket_that_comes_late(gate: tuple[int, Path, subprocess.Popen]) -> None:
    port, path, _ = gate
    result: list[bytes] = []
    client = threading.Thread(target=lambda: result.append(exchange(port, b"early request")))
    client.start()
    time.sleep(0.5)  # the daemon is restarting: nothing listens yet
    assert result == [] and client.is_alive()
    server = EchoServer(path)
    try:
        client.join(10)
    finally:
        server.close()
    assert result == [b"early request<eof seen>"]


def test_the_wait_is_bounded_then_the_connection_is_reset(gate: tuple[int, Path, subprocess.Popen]) -> None:
    port, path, proc = gate
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"nobody will answer")
        with pytest.raises(ConnectionResetError):
            while s.recv(100):
                pass
    proc.terminate()
    proc.wait(10)
    notes = [json.loads(line) for line in proc.stderr.read().splitlines()]  # type: ignore[union-attr]
    assert notes == [{"event": "modelgate.unreachable", "socket": str(path), "error": "FileNotFoundError",
                      "waited_s": 3.0}]


def test_listen_address_must_be_loopback(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(GATE), "--socket", str(tmp_path / "s"), "--listen", "0.0.0.0:18080"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--listen must be a loopback address" in out.stderr


def listening_line(tmp_path: Path, *extra: str) -> dict:
    proc = subprocess.Popen([sys.executable, str(GATE), "--socket", str(tmp_path / "model.sock"),
                             "--listen", f"127.0.0.1:{free_port()}", *extra], stderr=subprocess.PIPE, text=True)
    try:
        return json.loads(proc.stderr.readline())  # type: ignore[union-attr]
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_listening_line_carries_the_marker_it_was_pointed_at(tmp_path: Path) -> None:
    """The daemon checks a restarted sandbox's volume from this line (issue 16)."""
    marker = tmp_path / "marker"
    marker.write_text('{"identity": "abc", "volume_id": "0123"}\n')
    said = listening_line(tmp_path, "--marker", str(marker))
    assert (said["event"], said["marker"]) == ("modelgate.listening", '{"identity": "abc", "volume_id": "0123"}\n')
    assert "marker_error" not in said


def test_an_absent_marker_is_null_an_unreadable_one_says_why_and_no_flag_no_field(tmp_path: Path) -> None:
    assert listening_line(tmp_path, "--marker", str(tmp_path / "absent"))["marker"] is None
    said = listening_line(tmp_path, "--marker", str(tmp_path))  # a directory: read() fails
    assert (said["marker"], said["marker_error"]) == (None, "IsADirectoryError")
    assert "marker" not in listening_line(tmp_path)


def test_a_long_marker_is_cut_at_its_bound(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    marker.write_text("x" * 10_000)
    assert listening_line(tmp_path, "--marker", str(marker))["marker"] == "x" * 4096


def test_the_line_is_json_whatever_the_marker_holds(tmp_path: Path) -> None:
    """The line is written without json (its import came before the port listened): quotes,
    backslashes, control characters and non-ASCII text still read back exactly."""
    text = 'a "quoted" \\ back\tslash\x01 é 漢 🙂\n'
    marker = tmp_path / "marker"
    marker.write_text(text, encoding="utf-8")
    said = listening_line(tmp_path, "--marker", str(marker), "--connect-timeout=5")
    assert said == {"event": "modelgate.listening", "listen": said["listen"], "socket": str(tmp_path / "model.sock"),
                    "marker": text}


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    for argv, message in ((["--listen", "127.0.0.1:1"], "the following arguments are required: --socket"),
                          (["--socket", "s", "--bogus", "1"], "unrecognized argument '--bogus'"),
                          (["--socket", "s", "--connect-timeout", "soon"], "argument --connect-timeout: invalid float value: 'soon'"),
                          (["--socket", "s", "--listen", "127.0.0.1:http"], "argument --listen: bad port 'http'"),
                          (["--socket"], "argument --socket: expected one argument")):
        out = subprocess.run([sys.executable, str(GATE), *argv], capture_output=True, text=True, timeout=30)
        assert (out.returncode, out.stderr.splitlines()[-1]) == (2, f"ca-modelgate: error: {message}"), argv
