"""The engine's inspect reads, made straight on its unix socket (issue 16).

Every turn that starts a sandbox reads the engine before it may run (the data root's marker
volume, the image, the chat's volume, its container) and the SDK costs ~1.0 ms a read on this
machine, against ~0.44 ms for the same GET on a kept-alive connection: the rest is requests'
and urllib3's per-request machinery. These reads are plain GETs of JSON, so they go on a
connection of their own per worker thread (http.client, one request at a time, as a
connection allows), opened again once when the engine has closed it (a GET is safe to
repeat). Errors map as the SDK's do in :class:`sandbox_manager.engine.DockerEngine`: 404
is NotFound, 409 Conflict, anything else EngineError with the engine's own message.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from typing import Any
from urllib.parse import quote

from sandbox_manager.engine_errors import Conflict, EngineError, NotFound


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class EngineReads:
    """Blocking GETs of the engine's JSON (call from worker threads only)."""

    def __init__(self, socket_path: str, api_version: str, timeout_s: float) -> None:
        self._path = socket_path
        self._prefix = f"/v{api_version}"
        self._timeout_s = timeout_s
        self._local = threading.local()

    def container(self, ref: str) -> dict[str, Any]:
        return self._get(f"/containers/{quote(ref, safe='/:')}/json")

    def volume(self, name: str) -> dict[str, Any]:
        return self._get(f"/volumes/{quote(name, safe='/:')}")

    def image(self, ref: str) -> dict[str, Any]:
        return self._get(f"/images/{quote(ref, safe='/:')}/json")

    def _get(self, path: str) -> dict[str, Any]:
        url = self._prefix + path
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.request("GET", url)
                response = conn.getresponse()
                body = response.read()
                break
            except (http.client.HTTPException, OSError) as exc:
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise EngineError(f"GET {url}: {exc!r}") from exc
        if response.will_close:
            conn.close()
            self._local.conn = None
        if response.status >= 400:
            raise _error(response.status, url, body)
        return json.loads(body)

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = _UnixConnection(self._path, self._timeout_s)
        return conn


def _error(status: int, url: str, body: bytes) -> EngineError:
    try:
        message = json.loads(body).get("message") or ""
    except (ValueError, AttributeError):
        message = body[:200].decode(errors="replace")
    text = f"{status} GET {url}: {message}"
    if status == 404:
        return NotFound(text)
    if status == 409:
        return Conflict(text)
    return EngineError(text)
