"""What the daemon and its model proxy service say to each other (SPEC 12, 14).

The service listens on ``HOME/proxy/control.sock`` (directory 0700, socket 0600: the daemon's
user only; never mounted into a sandbox). One NDJSON line per request, ``{"id": N, "request":
{"op": ...}}``, answered by one line ``{"id": N, "ok": true, "result": {...}}`` or
``{"id": N, "ok": false, "error": "..."}``. Requests on one connection may be answered out of
order (a ``flush`` waits for a chat's exchanges while other turns begin and end).

The daemon hands the service its configuration on the service's stdin (``ServiceConfig``:
never in a command line, the environment or a file), and replaces a service whose ``hello``
names another build of the service's code or another configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from anyio.streams.buffered import BufferedByteReceiveStream
from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter

from proxy import ProxyConfig

MAX_LINE_BYTES = 4 << 20  # a metrics answer is the longest line
SOCKET_PATH_MAX = 107

# The project's files the service process runs (tests/unit/test_proxy_service.py checks the
# list against what the service imports): a change to any of them is another build.
BUILD_SOURCES = ("proxy", "state", "telemetry", "runner/__init__.py", "runner/model_proxy.py",
                 "runner/proxy_attribution.py", "runner/proxy_protocol.py", "runner/proxy_control.py",
                 "runner/proxy_service.py", "runner/event_loop.py", "runner/heap.py")
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def build_id(root: Path = PROJECT_ROOT) -> str:
    """A digest of the service's source files and the interpreter's version: two processes
    with the same build id run the same service code. Reads files: call it off the event loop."""
    h = hashlib.sha256(sys.version.encode())
    files: list[Path] = []
    for name in BUILD_SOURCES:
        path = root / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for path in files:
        h.update(b"\0" + str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


class ServicePaths:
    """The service's files under ``HOME/proxy``."""

    def __init__(self, home: Path) -> None:
        self.directory = Path(home) / "proxy"
        self.control = self.directory / "control.sock"
        self.lock = self.directory / "service.lock"  # held by the live service (flock)
        self.pid = self.directory / "service.pid"
        self.log = self.directory / "service.log"

    def prepare(self) -> None:
        """The directory, the daemon's user's alone (it holds the control socket). Blocking."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)

    def check(self) -> None:
        if len(str(self.control).encode()) > SOCKET_PATH_MAX:
            raise ValueError(f"home (CLOUD_AGENT_HOME): the model proxy's control socket {self.control} would be "
                             f"over the {SOCKET_PATH_MAX} bytes of a unix socket address; use a shorter home")


class ServiceConfig(BaseModel):
    """Everything the service runs with, from the daemon's settings."""

    model_config = ConfigDict(frozen=True)

    home: Path
    proxy: ProxyConfig
    store_url: SecretStr | None = Field(default=None, description="PostgreSQL (a fleet); None: SQLite at store_path")
    store_path: Path
    linger_s: float = Field(gt=0, description="exit after this long with no daemon and nothing in flight")

    @property
    def paths(self) -> ServicePaths:
        return ServicePaths(self.home)

    def to_json(self) -> str:
        """With the store URL in clear: for the service's stdin only."""
        doc = self.model_dump(mode="json")
        doc["store_url"] = self.store_url.get_secret_value() if self.store_url else None
        return json.dumps(doc, sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


# -- requests ---------------------------------------------------------------------------------


class Hello(BaseModel):
    op: Literal["hello"] = "hello"
    role: Literal["daemon", "operator"] = Field(description="while a daemon's connection is open the service "
                                                "does not linger out")


class Open(BaseModel):
    op: Literal["open"] = "open"
    chat_key: str
    user_id: str
    chat_id: str
    directory: Path


class Close(BaseModel):
    op: Literal["close"] = "close"
    chat_key: str


class Flush(BaseModel):
    op: Literal["flush"] = "flush"
    chat_key: str
    timeout_s: float = Field(gt=0)
    end_of: tuple[str, str] | None = None  # (member_key, job_id): an End after the flush


class Member(BaseModel):
    op: Literal["member"] = "member"
    chat_key: str
    member_key: str
    member_id: str


class Begin(BaseModel):
    op: Literal["begin"] = "begin"
    chat_key: str
    member_key: str
    member_id: str
    job_id: str


class End(BaseModel):
    op: Literal["end"] = "end"
    chat_key: str
    member_key: str
    job_id: str


class KeepTurns(BaseModel):
    op: Literal["keep_turns"] = "keep_turns"
    job_ids: list[str]


class Metrics(BaseModel):
    op: Literal["metrics"] = "metrics"


class Stop(BaseModel):
    op: Literal["stop"] = "stop"
    drain_s: float = Field(default=0.0, ge=0, description="wait this long at most for exchanges in flight")


Request = Annotated[Hello | Open | Close | Flush | Member | Begin | End | KeepTurns | Metrics | Stop,
                    Field(discriminator="op")]


class RequestLine(BaseModel):
    id: int
    request: Request


class AnswerLine(BaseModel):
    id: int
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None


# -- results ----------------------------------------------------------------------------------


class HelloResult(BaseModel):
    pid: int
    started_at: datetime
    build_id: str
    config_digest: str
    daemons: int = Field(description="daemon connections, this one included")
    in_flight: int
    sandboxes: int


class OpenResult(BaseModel):
    path: Path


class SampleSnapshot(BaseModel):
    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None


class FamilySnapshot(BaseModel):
    name: str
    documentation: str
    type: str
    unit: str = ""
    samples: list[SampleSnapshot]


class MetricsResult(BaseModel):
    families: list[FamilySnapshot]


# -- framing ----------------------------------------------------------------------------------

_REQUEST_LINE: TypeAdapter[RequestLine] = TypeAdapter(RequestLine)


def encode(line: BaseModel) -> bytes:
    return line.model_dump_json().encode() + b"\n"


async def read_line(stream: BufferedByteReceiveStream) -> bytes:
    """The next line without its newline (``anyio.IncompleteRead`` at the end of the stream,
    ``anyio.DelimiterNotFound`` for a line over ``MAX_LINE_BYTES``)."""
    return await stream.receive_until(b"\n", MAX_LINE_BYTES)


def parse_request(line: bytes) -> RequestLine:
    return _REQUEST_LINE.validate_json(line)
