"""From the bytes of one exchange to the audited fields of its ``WireRecord``.

Runs in a worker thread for the request body (JSON parsing of a long conversation is not
for the event loop), concurrently with the upstream's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .classify import Kind, classify
from .digest import DigestError, TextMessage, decode_body, text_messages
from .records import CapturedMessage, DigestEntry, digest_of
from .routes import Route


@dataclass(frozen=True)
class RequestAudit:
    kind: Kind
    digest: list[DigestEntry] | None
    digest_error: str | None
    capture: list[CapturedMessage] | None


def _captured(messages: list[TextMessage]) -> list[CapturedMessage]:
    return [CapturedMessage(role=m.role, text=m.text) for m in messages]


def audit_request(raw: bytes, content_encoding: str | None, route: Route, *, capture: bool) -> RequestAudit:
    """Kind, digest and (with capture) texts of one request body. Never raises."""
    if route.kind is not None or route.api is None:
        return RequestAudit(route.kind or "other", None, None, None)
    try:
        body = decode_body(raw, content_encoding)
        messages = text_messages(body, route.api)
        kind = classify(body, route.api)
    except DigestError as exc:
        return RequestAudit("other", None, str(exc), None)
    except Exception as exc:  # a digest bug must not cost the sandbox its answer
        return RequestAudit("other", None, f"digest failed: {exc.__class__.__name__}", None)
    if kind == "other":
        return RequestAudit(kind, None, "body is not a model request of this route's shape", None)
    return RequestAudit(kind, digest_of(messages), None, _captured(messages) if capture else None)


def reply_fields(messages: list[TextMessage] | None, *, capture: bool
                 ) -> tuple[list[DigestEntry] | None, list[CapturedMessage] | None]:
    if messages is None:
        return None, None
    return digest_of(messages), (_captured(messages) if capture else None)
