"""Test-only transport wrapper: make a CLI appear to report another session at settlement.

The identity regressions (SPEC 4.1, 9.2) need a settled turn — successful or a settled
failure — whose settlement evidence names a session other than the member's. No pinned CLI
does that on its own, so :class:`LocatorRewriter` (installed with
``TestHooks(wrap_transport=rewriter.wrap)``) wraps every process's transport and, only
while armed, rewrites the session id in exactly the line(s) each driver reads the observed
locator from:

========== ================================================================================
claude     the turn's root ``result`` (no ``parent_tool_use_id``, no ``origin``): its
           ``session_id``. ``TurnTracker.observed_locator`` is the first root id that differs
           from the expected one, so the root ``system/init`` (the other id-carrying line) is
           left alone: rewriting it would make the driver interrupt the turn mid-flight.
codex      ``turn/completed``: ``params.threadId`` (the tracker matches it on the turn id only).
pi         the ``get_state`` *barrier* answers (``data.sessionId``): the driver sends a barrier
           after ``agent_end`` and settles on its answer. Barriers are recognised by id — the
           ``get_state`` commands written after a ``prompt`` on this transport — never the
           handshake's ``get_state``.
opencode,  the bridge's ``settled`` line: ``session_id``.
kilo
========== ================================================================================

Armed with ``at="handshake"``, it rewrites instead the session id a *resume handshake*
reports (SPEC 3: "the resume handshake reports another session" is LOST):

========== ================================================================================
codex      the answer to ``thread/resume``: ``result.thread.id``.
pi         the handshake's ``get_state`` answer (before any ``prompt``): ``data.sessionId``.
opencode,  the bridge's ``opened`` line: ``session_id``.
kilo
claude     none: its resume handshake (``initialize``) names no session; a resumed Claude
           proves its id at settlement (the ``at="settlement"`` rows above).
========== ================================================================================

Everything else passes through byte for byte. Each rewrite is recorded so a test can prove
the wrapper hit the evidence line (and nothing else).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from drivers.transport import Transport


@dataclass
class Rewrite:
    runtime: str
    kind: str  # which evidence line: "result" | "turn/completed" | "get_state" | "settled"
    original: str | None
    forged: str


@dataclass
class LocatorRewriter:
    """Arm for one turn with :meth:`arm`; :attr:`rewrites` lists what was changed."""

    forged: str | None = None
    runtime: str | None = None
    at: str = "settlement"  # or "handshake"
    rewrites: list[Rewrite] = field(default_factory=list)
    generation: int = 0  # bumped on every arm: per-transport bookkeeping starts afresh

    def arm(self, runtime: str, forged: str, *, at: str = "settlement") -> None:
        assert at in ("settlement", "handshake")
        self.runtime, self.forged, self.at = runtime, forged, at
        self.rewrites = []
        self.generation += 1

    def disarm(self) -> list[Rewrite]:
        self.runtime = self.forged = None
        self.at = "settlement"
        return self.rewrites

    def active(self, runtime: str) -> str | None:
        return self.forged if self.runtime == runtime else None

    def wrap(self, transport: Transport, runtime: str) -> Transport:
        return RewritingTransport(transport, runtime, self)


class RewritingTransport:
    def __init__(self, inner: Transport, runtime: str, rewriter: LocatorRewriter) -> None:
        self.inner = inner
        self.runtime = runtime
        self.rewriter = rewriter
        self._generation = -1
        self._prompt_sent = False  # pi: a prompt went out since arming, so get_state = barrier
        self._barriers: set[str] = set()
        self._ever_prompted = False  # pi: the handshake's get_state comes before any prompt
        self._resume_ids: set[str] = set()  # codex: ids of thread/resume requests

    # -- outgoing: only observed (pi barrier ids, codex resume ids), never changed
    async def send(self, line: bytes) -> None:
        obj = _json(line)
        if obj is not None and obj.get("type") == "prompt":
            self._ever_prompted = True
        if obj is not None and obj.get("method") == "thread/resume":
            self._resume_ids.add(str(obj.get("id")))
        if self.runtime == "pi" and self.rewriter.active("pi") is not None:
            if self._generation != self.rewriter.generation:
                self._generation, self._prompt_sent, self._barriers = self.rewriter.generation, False, set()
            if obj is not None and obj.get("type") == "prompt":
                self._prompt_sent = True
            elif obj is not None and obj.get("type") == "get_state" and self._prompt_sent:
                self._barriers.add(str(obj.get("id")))
        await self.inner.send(line)

    # -- incoming: the settlement evidence line gets the forged id
    async def receive(self) -> bytes | None:
        line = await self.inner.receive()
        forged = self.rewriter.active(self.runtime)
        if line is None or forged is None:
            return line
        obj = _json(line)
        if obj is None:
            return line
        hit = self._rewrite(obj, forged)
        if hit is None:
            return line
        kind, original = hit
        self.rewriter.rewrites.append(Rewrite(runtime=self.runtime, kind=kind, original=original, forged=forged))
        return json.dumps(obj, ensure_ascii=False).encode()

    def _rewrite(self, obj: dict[str, Any], forged: str) -> tuple[str, str | None] | None:
        if self.rewriter.at == "handshake":
            return self._rewrite_handshake(obj, forged)
        if self.runtime == "claude":
            if obj.get("type") == "result" and obj.get("parent_tool_use_id") is None and "origin" not in obj:
                original, obj["session_id"] = obj.get("session_id"), forged
                return "result", original
        elif self.runtime == "codex":
            params = obj.get("params")
            if obj.get("method") == "turn/completed" and isinstance(params, dict):
                original, params["threadId"] = params.get("threadId"), forged
                return "turn/completed", original
        elif self.runtime == "pi":
            data = obj.get("data")
            if (obj.get("type") == "response" and obj.get("command") == "get_state" and str(obj.get("id")) in
                    self._barriers and isinstance(data, dict)):
                original, data["sessionId"] = data.get("sessionId"), forged
                return "get_state", original
        elif self.runtime in ("opencode", "kilo"):
            if obj.get("type") == "settled":
                original, obj["session_id"] = obj.get("session_id"), forged
                return "settled", original
        return None

    def _rewrite_handshake(self, obj: dict[str, Any], forged: str) -> tuple[str, str | None] | None:
        if self.runtime == "codex":
            thread = (obj.get("result") or {}).get("thread") if isinstance(obj.get("result"), dict) else None
            if str(obj.get("id")) in self._resume_ids and isinstance(thread, dict):
                original, thread["id"] = thread.get("id"), forged
                return "thread/resume", original
        elif self.runtime == "pi":
            data = obj.get("data")
            if (obj.get("type") == "response" and obj.get("command") == "get_state" and not self._ever_prompted
                    and isinstance(data, dict)):
                original, data["sessionId"] = data.get("sessionId"), forged
                return "get_state", original
        elif self.runtime in ("opencode", "kilo"):
            if obj.get("type") == "opened":
                original, obj["session_id"] = obj.get("session_id"), forged
                return "opened", original
        return None

    # -- the rest of the Transport protocol: delegated
    async def close(self) -> None:
        await self.inner.close()

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def diagnostics(self) -> str:
        return self.inner.diagnostics()


def _json(line: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None
