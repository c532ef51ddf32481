"""sandbox_manager.engine_reads against a stdlib HTTP/1.1 server on a unix socket: the paths
and answers the engine's API has, its error statuses, kept-alive connections per thread, and
a connection the engine closed."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from sandbox_manager.engine_errors import Conflict, EngineError, NotFound
from sandbox_manager.engine_reads import EngineReads


class Engine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str) -> None:
        self.seen: list[tuple[str, int]] = []  # (path, client port: the connection it came on)
        self.answers: dict[str, tuple[int, bytes]] = {}
        self.chunked = False
        self.close_after = False
        self.connections = 0
        super().__init__(path, Handler)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Engine

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1
        self.conn_no = self.server.connections

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.seen.append((self.path, self.conn_no))
        status, body = self.server.answers.get(self.path, (404, b'{"message":"No such thing"}'))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if self.server.chunked:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            half = len(body) // 2
            for part in (body[:half], body[half:], b""):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        if self.server.close_after:
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine(tmp_path) -> Iterator[tuple[Engine, EngineReads]]:
    path = str(tmp_path / "docker.sock")
    server = Engine(path)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, EngineReads(path, "1.41", timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()


def test_reads_get_the_engine_api_paths_and_return_their_json(engine) -> None:
    server, reads = engine
    doc = {"Id": "c1", "Name": "/sandbox-x", "State": {"Status": "running"}}
    server.answers = {
        "/v1.41/containers/sandbox-x/json": (200, json.dumps(doc).encode()),
        "/v1.41/volumes/cloud-agent-v1": (200, b'{"Name":"cloud-agent-v1","Labels":{"a":"b"}}'),
        "/v1.41/images/cloud-agent-sandbox:abc/json": (200, b'{"Id":"sha256:1","RepoTags":["cloud-agent-sandbox:abc"]}'),
    }
    assert reads.container("sandbox-x") == doc
    assert reads.volume("cloud-agent-v1") == {"Name": "cloud-agent-v1", "Labels": {"a": "b"}}
    assert reads.image("cloud-agent-sandbox:abc") == {"Id": "sha256:1", "RepoTags": ["cloud-agent-sandbox:abc"]}
    # one kept-alive connection carried all three
    assert [conn for _, conn in server.seen] == [1, 1, 1]


def test_a_chunked_answer_is_read_whole(engine) -> None:
    server, reads = engine
    server.chunked = True
    body = json.dumps({"Id": "c1", "pad": "x" * 5000}).encode()
    server.answers = {"/v1.41/containers/c1/json": (200, body)}
    assert reads.container("c1") == json.loads(body)
    assert reads.container("c1") == json.loads(body)
    assert [conn for _, conn in server.seen] == [1, 1]


def test_error_statuses_map_as_the_sdk_calls_do_with_the_engines_message(engine) -> None:
    server, reads = engine
    server.answers = {"/v1.41/containers/busy/json": (409, b'{"message":"is busy"}'),
                      "/v1.41/volumes/broken": (500, b"not json")}
    with pytest.raises(NotFound) as nf:
        reads.container("gone")
    assert str(nf.value) == "404 GET /v1.41/containers/gone/json: No such thing"
    with pytest.raises(Conflict) as cf:
        reads.container("busy")
    assert str(cf.value) == "409 GET /v1.41/containers/busy/json: is busy"
    with pytest.raises(EngineError) as err:
        reads.volume("broken")
    assert type(err.value) is EngineError and str(err.value) == "500 GET /v1.41/volumes/broken: not json"
    # the connection is still good after each error answer
    assert [conn for _, conn in server.seen] == [1, 1, 1]


def test_a_connection_the_engine_closed_is_opened_again_once(engine) -> None:
    server, reads = engine
    server.answers = {"/v1.41/volumes/v": (200, b'{"Name":"v"}')}
    server.close_after = True  # answers with Connection: close, then closes
    assert reads.volume("v") == {"Name": "v"}
    assert reads.volume("v") == {"Name": "v"}
    assert [conn for _, conn in server.seen] == [1, 2]


def test_each_thread_has_its_own_connection(engine) -> None:
    server, reads = engine
    server.answers = {"/v1.41/volumes/v": (200, b'{"Name":"v"}')}
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.extend([reads.volume("v"), reads.volume("v")]))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [{"Name": "v"}] * 6
    by_conn: dict[int, int] = {}
    for _, conn in server.seen:
        by_conn[conn] = by_conn.get(conn, 0) + 1
    assert sorted(by_conn.values()) == [2, 2, 2]


def test_an_engine_that_is_not_there_is_an_engine_error_naming_the_call(tmp_path) -> None:
    reads = EngineReads(str(tmp_path / "absent.sock"), "1.41", timeout_s=5)
    with pytest.raises(EngineError) as err:
        reads.container("c1")
    assert type(err.value) is EngineError
    assert str(err.value).startswith("GET /v1.41/containers/c1/json: FileNotFoundError(")
    assert not Path(tmp_path / "absent.sock").exists()
