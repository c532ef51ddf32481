"""Recorder: every request the fixture answers, in memory (thread-safe) and optionally as JSONL.

Secrets never reach a record: authentication headers are dropped by name before the record is
built (the keys the CLIs send are dummies, but a fixture pointed at by a real key must not
keep it either). What a record keeps of them is a fingerprint (``credential_fingerprints``):
enough for a test to prove which key arrived — the model proxy's key swap — and useless to
anyone reading the records.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Iterable
from pathlib import Path

from .models import RecordedRequest

SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key",
                            "cookie", "set-cookie"})
_SECRET_PARTS = ("secret", "token", "password", "api-key", "apikey")


def safe_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Lower-cased header map without credentials; repeated headers are joined with ", "."""
    out: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        if key in SECRET_HEADERS or any(p in key for p in _SECRET_PARTS):
            continue
        out[key] = f"{out[key]}, {value}" if key in out else value
    return out


def fingerprint(secret: str) -> str:
    """``sha256:`` + the first 16 hex digits of the secret's sha256."""
    return "sha256:" + hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def credential_fingerprints(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Each credential header as its fingerprint; a bearer token keeps its scheme."""
    out: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        if key in SECRET_HEADERS or any(p in key for p in _SECRET_PARTS):
            scheme, _, token = value.partition(" ")
            out[key] = f"{scheme} {fingerprint(token)}" if token and scheme.lower() == "bearer" else fingerprint(value)
    return out


class Recorder:
    def __init__(self, path: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._records: list[RecordedRequest] = []
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    def add(self, record: RecordedRequest) -> None:
        """Make a record visible at once (status may still change while its stream runs)."""
        with self._lock:
            self._records.append(record)

    def finish(self, record: RecordedRequest) -> None:
        """Append the final state of a record to the JSONL file, if any."""
        if self.path is None:
            return
        line = record.model_dump_json() + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line)

    def all(self) -> list[RecordedRequest]:
        with self._lock:
            records = [r.model_copy(deep=True) for r in self._records]
        return sorted(records, key=lambda r: r.seq)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


def load_jsonl(path: str | Path) -> list[RecordedRequest]:
    """Read a ``--record`` file back."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [RecordedRequest.model_validate_json(line) for line in lines if line.strip()]
