"""Human table and ``--json`` document of a preflight run."""

from __future__ import annotations

import json
import unicodedata
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from deploy.preflight.verdict import CaseResult, Summary

_EXCERPT_WIDTH = 60
_COLUMNS = ("case", "rep", "lang", "recall_passed", "thinking_observed", "request id", "answer excerpt")


def public_url(url: str) -> str:
    """``url`` without user:password, so a credential in the URL is never printed."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=host))


def _width(text: str) -> int:
    # Chinese answers take two terminal columns per character; without this the table
    # misaligns on exactly the answers an operator most needs to read.
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _fit(text: str, width: int) -> str:
    text = " ".join(text.split())
    if _width(text) <= width:
        return text
    out, used = "", 0
    for ch in text:
        w = _width(ch)
        if used + w > width - 1:
            break
        out, used = out + ch, used + w
    return out + "…"


def _pad(text: str, width: int) -> str:
    return text + " " * max(0, width - _width(text))


def _row(r: CaseResult) -> list[str]:
    return [r.case, str(r.repetition), r.lang, "yes" if r.recall_passed else "NO",
            "yes" if r.thinking_observed else "no", r.request_id or "-",
            _fit(r.answer, _EXCERPT_WIDTH) or "-"]


def render_table(results: list[CaseResult], summary: Summary, all_answers: bool = False) -> str:
    rows = [list(_COLUMNS)] + [_row(r) for r in results]
    widths = [max(_width(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for i, (row, result) in enumerate(zip(rows, [None, *results])):
        lines.append("  ".join(_pad(cell, w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
        elif result is not None:
            lines += [f"    -> {why}" for why in result.failures]
    lines.append("")
    lines.append(
        f"recall_passed: {'yes' if summary.recall_passed else 'NO'} "
        f"({summary.cases - summary.failed}/{summary.cases} cases)   "
        f"thinking_observed: {'yes' if summary.thinking_observed else 'no'} "
        f"({summary.thinking_observed_cases}/{summary.cases} cases)"
    )
    # Full answers: always for failed cases (the operator has to judge them, e.g. a
    # reply that quoted a bad claim to correct it), for every case with --answers.
    shown = [r for r in results if all_answers or not r.recall_passed]
    for r in shown:
        lines += ["", f"--- {r.case} #{r.repetition} ({r.lang}) request id {r.request_id or '-'}",
                  r.answer or "(no answer text)"]
    return "\n".join(lines)


def render_json(results: list[CaseResult], summary: Summary, meta: dict[str, Any]) -> str:
    doc = {**meta, "summary": summary.model_dump(), "results": [r.model_dump() for r in results]}
    return json.dumps(doc, ensure_ascii=False, indent=2)
