"""Classifying why a settled turn failed, from what the CLI itself said."""

from __future__ import annotations

import re

from drivers.models import FailureReason

_CONTEXT = re.compile(
    r"context_length_exceeded|prompt[_ ]is[_ ]too[_ ]long|maximum context length is \d+ tokens|"
    r"exceeds the context window|context window|too many tokens|ContextOverflowError|context_too_long",
    re.IGNORECASE,
)
_RATE = re.compile(r"\b429\b|rate[_ ]?limit|too many requests|RateLimit", re.IGNORECASE)
_OVERLOADED = re.compile(r"\b529\b|overloaded|high demand|service unavailable|\b503\b", re.IGNORECASE)
_AUTH = re.compile(r"\b401\b|\b403\b|authentication|invalid api key|unauthori[sz]ed|ProviderAuthError|permission_error",
                   re.IGNORECASE)
_ABORTED = re.compile(r"\baborted\b|interrupted|MessageAbortedError|Request was aborted", re.IGNORECASE)


def classify_failure(*texts: object, status: int | None = None) -> FailureReason:
    """Map CLI error text / codes / HTTP status to a :class:`FailureReason`.

    The order matters: a context-window refusal arrives as a 400 and must not be
    reported as a generic API error; an abort is checked last so an error message that
    merely mentions aborting does not hide a rate limit.
    """
    blob = " ".join(str(t) for t in texts if t is not None)
    if _CONTEXT.search(blob):
        return FailureReason.CONTEXT_TOO_LONG
    if status == 429 or _RATE.search(blob):
        return FailureReason.RATE_LIMITED
    if status in (503, 529) or _OVERLOADED.search(blob):
        return FailureReason.OVERLOADED
    if status in (401, 403) or _AUTH.search(blob):
        return FailureReason.AUTH
    if _ABORTED.search(blob):
        return FailureReason.ABORTED
    return FailureReason.API_ERROR
