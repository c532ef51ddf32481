"""The allow-list: the only requests a sandbox may send upstream (SPEC 12).

A request path is ``/m/<member key><route path>``: the member prefix is the base URL each
member's CLI is configured with (``member_base_url``), and the proxy strips it. Only an exact
``(method, route path)`` below is forwarded, always to the route's own canonical path (never a
path the sandbox spelled), with the sandbox's query string; anything else is answered 403.

Where each entry comes from (the pinned CLIs, shared/protocols and the loopback fixture's
records of the real CLIs sending through a ``/m/<member>`` base URL, tests/cli driver suites,
2026-12-01; recordings in tests/data/loopback/*.jsonl):

* ``POST /v1/messages`` — Claude Code 2.1.220, always with ``?beta=true`` (claude-code.md §2,
  §13); pi 0.73.1 with the product's ``anthropic-messages`` provider (pi.md §2,
  drivers' pi config). Streaming SSE; retries, summaries and subagents use the same route.
* ``HEAD /api/hello`` — Claude Code 2.1.220's preconnect, once per process start, even with
  ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1``; sent *under the base URL's path* (recorded
  as ``HEAD /m/<member>/api/hello``). A side request.
* ``POST /v1/responses`` — Codex 0.171.0 (``{base_url}/responses``, codex.md §3), compaction
  summaries included.
* ``POST /v1/chat/completions`` — OpenCode 1.18.33 and Kilo 7.7.7 (opencode-kilo.md §3, title
  requests included); pi 0.73.1 with ``openai-completions``.
* ``POST /v1/messages/count_tokens`` and ``GET /v1/models`` — named by SPEC 12 as side routes;
  none of the pinned CLIs sent them in any recorded run (Claude never calls count_tokens or
  models, claude-code.md §2; OpenCode/Kilo/pi take models from their config, Codex from its
  bundled catalogue). Allowed so a CLI that asks gets the gateway's real answer.

Not allowed, although a CLI may try them: ``HEAD /`` (Claude 2.1.197, not pinned), the
CLIs' telemetry, update and catalogue hosts (they are other hosts: a sealed sandbox cannot
name them, and the member prefix cannot reach them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from .classify import Kind

ApiFamily = Literal["anthropic", "openai"]
MEMBER_PREFIX = "/m/"
_MEMBER_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Route:
    name: str
    method: str
    path: str
    family: ApiFamily | None  # the key's shape; None: the shape the CLI used for its placeholder
    api: Literal["anthropic", "responses", "chat"] | None  # the body's shape, for the digest
    kind: Kind | None  # fixed kind of a side route; None: classified from the body
    source: str


ROUTES: tuple[Route, ...] = (
    Route("anthropic.messages", "POST", "/v1/messages", "anthropic", "anthropic", None,
          "Claude Code 2.1.220 (?beta=true); pi 0.73.1 anthropic-messages"),
    Route("anthropic.preconnect", "HEAD", "/api/hello", "anthropic", None, "probe",
          "Claude Code 2.1.220 preconnect"),
    Route("anthropic.count_tokens", "POST", "/v1/messages/count_tokens", "anthropic", None, "count_tokens",
          "SPEC 12 side route; not sent by the pinned CLIs"),
    Route("openai.responses", "POST", "/v1/responses", "openai", "responses", None, "Codex 0.171.0"),
    Route("openai.chat", "POST", "/v1/chat/completions", "openai", "chat", None,
          "OpenCode 1.18.33, Kilo 7.7.7; pi 0.73.1 openai-completions"),
    Route("models", "GET", "/v1/models", None, None, "models", "SPEC 12 side route; not sent by the pinned CLIs"),
)
_BY_KEY = {(r.method, r.path): r for r in ROUTES}


@dataclass(frozen=True)
class Target:
    """A parsed request target: the member, the route path, the query (all still unchecked)."""

    member_key: str | None
    path: str
    query: str


def parse_target(target: str) -> Target:
    path, _, query = target.partition("?")
    if not path.startswith(MEMBER_PREFIX):
        return Target(None, path, query)
    member, slash, rest = path[len(MEMBER_PREFIX):].partition("/")
    if not _MEMBER_KEY.match(member):
        return Target(None, path, query)
    return Target(member, slash + rest, query)


def match(method: str, path: str) -> Route | None:
    return _BY_KEY.get((method.upper(), path))


def valid_member_key(key: str) -> bool:
    return bool(_MEMBER_KEY.match(key))


def member_base_url(port: int, member_key: str) -> str:
    """What a member's CLI is configured with inside its sandbox (the forwarder's address)."""
    if not valid_member_key(member_key):
        raise ValueError(f"member_key: {member_key!r} is not 1-128 of [A-Za-z0-9._-] starting alphanumeric")
    return f"http://127.0.0.1:{port}{MEMBER_PREFIX}{member_key}"
