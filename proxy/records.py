"""The wire audit's records: one ``WireRecord`` per request through the proxy (SPEC 12).

Records hold digests only. Message texts are kept only when the operator turns capture on
(``CLOUD_AGENT_WIRE_CAPTURE=1``); the store applies ``CLOUD_AGENT_WIRE_CAPTURE_DAYS``. No
header value is ever recorded, so the real key cannot reach a record.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import compress, count
from operator import is_not
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from .classify import Kind
from .digest import TextMessage

ApiShape = Literal["anthropic", "responses", "chat"]


@dataclass(frozen=True, slots=True)
class DigestEntry:
    """One user/assistant text message of a request, as its role and the sha256 of its text."""

    # A slotted dataclass, not a model: a request carries one entry per message of its whole
    # history, so a long chat's turn makes and reads hundreds (the proxy's digest, the judge's
    # records, the member's baseline). Made here it costs 0.6 µs, a BaseModel 1.7 µs; read
    # from JSON inside a record, pydantic validates it (the pattern too) in about 60% of the
    # model's time. Its JSON and schema are a model's: {"role": ..., "sha256": ...}.
    role: Literal["user", "assistant"]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]

    @classmethod
    def of(cls, message: TextMessage) -> DigestEntry:
        return cls(message.role, message.sha256)  # our own hash: nothing to validate

    @classmethod
    def text(cls, role: Literal["user", "assistant"], text: str) -> DigestEntry:
        return cls.of(TextMessage(role, text))


def digest_of(messages: Iterable[TextMessage]) -> list[DigestEntry]:
    return [DigestEntry.of(m) for m in messages]


def common_prefix(a: Sequence[DigestEntry], b: Sequence[DigestEntry]) -> int:
    """How many leading entries ``a`` and ``b`` have in common, compared in C.

    A long chat's digest is hundreds of entries, compared on every turn, and one __eq__ call
    per entry was most of the judge. A digest rebuilt from its parent record shares the
    parent's entry objects (proxy.stored_digest.rebuild), and the member's baseline is that
    same list, so the usual common prefix is found by identity; past the first entry that is
    not the same object, the rest is compared by value as tuples."""
    n = min(len(a), len(b))
    same = next(compress(count(), map(is_not, a, b)), n)  # the first position holding two objects
    if same == n:
        return n
    rest_a, rest_b = _keys(a[same:n]), _keys(b[same:n])
    if rest_a == rest_b:
        return n
    return same + next(i for i, (x, y) in enumerate(zip(rest_a, rest_b, strict=True)) if x != y)


def _keys(entries: Sequence[DigestEntry]) -> list[tuple[str, str]]:
    return [(e.role, e.sha256) for e in entries]


class CapturedMessage(BaseModel):
    """A message text, kept only with capture on."""

    role: Literal["user", "assistant"]
    text: str


class WireRecord(BaseModel):
    """One request a sandbox sent through the model proxy, and what became of it."""

    model_config = ConfigDict(json_schema_extra={"title": "WireRecord"})

    seq: int = Field(description="arrival order within this proxy process")
    chat_key: str = Field(description="the sandbox whose socket accepted the connection")
    member_key: str | None = Field(description="from the /m/<member key> path prefix")
    job_id: str | None = Field(description="the member's running turn when the request arrived")
    started_at: datetime
    duration_ms: float
    method: str
    path: str = Field(description="the path forwarded upstream (member prefix stripped, no query)")
    route: str | None = Field(description="the allow-list entry that matched; None when denied")
    api: ApiShape | None = Field(description="the API shape of the route")
    kind: Kind
    side: bool = Field(description="a side request (preconnect, title, summary, subagent, models, count-tokens)")
    status: int = Field(description="the status the sandbox got (the upstream's, unchanged, when forwarded)")
    upstream_request_id: str | None = None
    bytes_in: int = Field(description="request body bytes received from the sandbox")
    bytes_out: int = Field(description="response body bytes sent to the sandbox")
    error: str | None = Field(default=None, description="why the proxy answered itself or the exchange broke off")
    digest: list[DigestEntry] | None = Field(default=None, description="conversation digest; None if unreadable")
    digest_error: str | None = None
    # How the ledger stores a digest (proxy.stored_digest): a reader gets it whole, never these
    digest_parent: str | None = Field(default=None, description="stored as a difference: the record whose "
                                      "digest this one's starts with (its entries after them are in digest)")
    digest_shared: int | None = Field(default=None, description="stored as a difference: how many entries of "
                                      "the parent record's digest this one starts with")
    reply: list[DigestEntry] | None = Field(default=None, description="assistant text the response carried")
    capture: list[CapturedMessage] | None = Field(default=None, description="request texts (capture on only)")
    reply_capture: list[CapturedMessage] | None = None

    @property
    def conversational(self) -> bool:
        return self.route is not None and not self.side


class WireSink(Protocol):
    """Where records go (the store in production). Must not raise for a valid record;
    the proxy logs and drops a record whose sink fails, the answer to the sandbox is unaffected."""

    async def put(self, record: WireRecord) -> None: ...

