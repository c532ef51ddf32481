"""From the bytes of one exchange to the audited fields of its ``WireRecord``.

Runs in a worker thread for the request body (JSON parsing of a long conversation is not
for the event loop), concurrently with the upstream's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .audit_memo import AuditMemo, ItemResult
from .classify import Kind, classify
from .digest import (
    DigestError,
    TextMessage,
    conversation_items,
    decode_body,
    item_messages,
)
from .records import CapturedMessage, DigestEntry, digest_of
from .routes import Route


@dataclass(frozen=True)
class RequestAudit:
    kind: Kind
    digest: list[DigestEntry] | None
    digest_error: str | None
    capture: list[CapturedMessage] | None
    remembered: int = 0  # conversation messages whose results came from the member's last request
    walked: int = 0  # conversation messages walked


def _captured(messages: list[TextMessage]) -> list[CapturedMessage]:
    return [CapturedMessage(role=m.role, text=m.text) for m in messages]


def audit_request(raw: bytes, content_encoding: str | None, route: Route, *, capture: bool,
                  memo: AuditMemo | None = None, member: tuple[str, str] | None = None) -> RequestAudit:
    """Kind, digest and (with capture) texts of one request body. Never raises. With ``memo``
    and the request's ``member`` (chat key, member key), the messages it shares with the
    member's last conversational request are not walked again (proxy.audit_memo)."""
    if route.kind is not None or route.api is None:
        return RequestAudit(route.kind or "other", None, None, None)
    api = route.api
    try:
        body = decode_body(raw, content_encoding)
        kind = classify(body, api)
        items = conversation_items(body, api)
        if isinstance(items, str):  # a plain Responses input: one user message
            results: list[ItemResult] = [((m := TextMessage("user", items), DigestEntry.of(m)),)]
            remembered = 0
        else:
            items = items or []
            results = memo.shared(member, api, items) if memo is not None and member is not None else []
            remembered = len(results)
            results += [tuple((m, DigestEntry.of(m)) for m in item_messages(item, api)) for item in items[remembered:]]
    except DigestError as exc:
        return RequestAudit("other", None, str(exc), None)
    except Exception as exc:  # a digest bug must not cost the sandbox its answer
        return RequestAudit("other", None, f"digest failed: {exc.__class__.__name__}", None)
    if kind == "other":
        return RequestAudit(kind, None, "body is not a model request of this route's shape", None)
    if memo is not None and member is not None and kind == "conversation" and isinstance(items, list):
        memo.keep(member, api, items, results, len(raw))
    pairs = [pair for result in results for pair in result]
    messages = [m for m, _ in pairs]
    return RequestAudit(kind, [e for _, e in pairs], None, _captured(messages) if capture else None,
                        remembered=remembered, walked=len(results) - remembered)


def reply_fields(messages: list[TextMessage] | None, *, capture: bool
                 ) -> tuple[list[DigestEntry] | None, list[CapturedMessage] | None]:
    if messages is None:
        return None, None
    return digest_of(messages), (_captured(messages) if capture else None)
