"""Integrity facts of running sandboxes, kept fresh by the engine's event stream (issue 16).

Before a turn the sandbox manager proves the chat's container is the recorded one (data
root identity, container inspect, image inspect: three engine calls). For a LIVE turn the
answer almost never changes between turns, so a container's verified facts are kept here
and dropped the moment the engine says anything that could change them:

* a container event other than exec/attach/archive traffic (die, kill, stop, destroy,
  pause, rename, update, oom, restart, ...) drops that container's facts;
* an image ``delete``/``untag``, any event of the data-root marker volume, or a daemon
  event (reload) drops every fact;
* a chat's state volume (SPEC 15) removed or created anew drops the facts of the container
  checked on it (the engine refuses to remove a volume in use, so its container's destroy
  comes first anyway; this keeps the rule local rather than relying on that);
* the stream itself ending, failing or not yet connected (an engine restart, a reconnect)
  drops every fact, and no fact is kept until the stream is connected again.

Two facts of the engine itself are kept the same way (:meth:`IntegrityFacts.engine_fact`):
the configured image's check and the data root's identity, which every new sandbox is made
and labelled with (two engine calls, ~4 ms of a ~215 ms create; a turn's check of an existing
sandbox still asks the engine for both). Any
image event drops them (a tag moved onto another image says ``tag``, not ``untag``), and so
does everything that drops every fact: a data root swapped under a running daemon comes with an
engine restart, which ends the stream.

Facts are only stored with a token taken *before* the check that produced them, so a fact
whose check raced an invalidating event is never kept. Without a live stream every turn
inspects, exactly as before: the cache can only make a check cheaper, never weaker.

The engine's events also say when a container stopped (:meth:`IntegrityFacts.stopped_between`):
a resident's turn whose CLI link ended at once learns from them whether the container had
stopped before the turn wrote its message, so that its CLI never read it (runner/turn.py).

The follower (:meth:`IntegrityFacts.follow`) runs in the supervisor's task group.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import structlog

from sandbox_manager.engine import DATA_ROOT_VOLUME, ContainerInfo, Engine, ImageInfo

log = structlog.get_logger("integrity")

T = TypeVar("T")

EVENT_FILTERS = {"type": ["container", "image", "volume", "daemon"]}
# container actions that change nothing a check looks at (our own turns make them all the time),
# and a container's own beginning: its ``create`` and first ``start`` reach the stream after the
# creating call returned, and would spoil the facts its creation stores (issue 16). Facts are
# only kept for a running container, and one that runs again after a stop lost them to its
# ``die``; a check that raced that ``die`` is not kept.
HARMLESS = frozenset({"exec_create", "exec_start", "exec_die", "exec_detach", "attach", "detach", "resize", "top",
                      "archive-path", "extract-to-dir", "export", "copy", "commit", "create", "start"})

# volume actions that change what a state volume's check established (mount/unmount are
# the container's own start and stop, seen as container events)
VOLUME_GONE = frozenset({"destroy", "create"})

# the last destroys remembered by id, so that a check of one container is not spoiled by another's
# removal (a host's other chats come and go, and its start-up probe's container goes as the
# first chat's sandbox is created); a check that outlived more destroys than this is not kept
RECENT_DESTROYS = 256

# containers whose stops (``die``, or a ``destroy`` with no ``die`` before it) are remembered
RECENT_STOPS = 256


@dataclass(frozen=True)
class Facts:
    """What a full check established for one running container."""

    container: ContainerInfo
    image: ImageInfo
    data_root_id: str
    volume: str | None = None  # the chat's state volume the check covered


@dataclass(frozen=True)
class Token:
    connection: int
    generation: int
    container_generation: int
    destroyed: int  # destroys seen when the check began


@dataclass(frozen=True)
class EngineToken:
    connection: int
    generation: int
    image_events: int


class IntegrityFacts:
    def __init__(self, engine: Engine, *, reconnect_s: float = 0.5, max_reconnect_s: float = 5.0) -> None:
        self.engine = engine
        self.reconnect_s = reconnect_s
        self.max_reconnect_s = max_reconnect_s
        self._facts: dict[str, Facts] = {}
        self._connection = 0  # 0 while no stream is connected
        self._generation = 0  # bumped by every invalidation of everything
        # per container: bumped by each of its events that drops facts (a check that began before
        # it is not kept). A destroyed container's entry goes (its id never comes back) and its
        # id joins the recent destroys, which a check that began before the destroy is held against.
        self._container_gen: dict[str, int] = {}
        self._destroyed = 0
        self._recent: deque[str] = deque(maxlen=RECENT_DESTROYS)
        self.events_seen = 0
        self._engine_facts: dict[str, Any] = {}  # the engine's own: the image check, the data root
        self._image_events = 0
        # per container (the last RECENT_STOPS): when each of its stops happened, ns since the epoch
        # on the engine's clock, which is this host's (the engine is local: sandboxes mount the
        # daemon's sockets from this host's file system)
        self._stops: OrderedDict[str, list[int]] = OrderedDict()
        self._stopped = anyio.Event()  # set (and replaced) whenever a stop is noted

    @property
    def live(self) -> bool:
        return self._connection != 0

    # -- the turn side -------------------------------------------------------------------------

    def token(self, container_id: str) -> Token | None:
        """Taken before a check; None while facts cannot be kept (no live stream)."""
        if not self._connection:
            return None
        return Token(self._connection, self._generation, self._container_gen.get(container_id, 0), self._destroyed)

    def put(self, token: Token | None, facts: Facts) -> None:
        cid = facts.container.id
        if (token is None or (token.connection, token.generation) != (self._connection, self._generation)
                or token.container_generation != self._container_gen.get(cid, 0) or self._destroyed_since(token, cid)):
            return  # something happened to it since the check began: keep nothing
        self._facts[cid] = facts

    def get(self, container_id: str, data_root_id: str) -> Facts | None:
        if not self._connection:
            return None
        facts = self._facts.get(container_id)
        if facts is None or facts.data_root_id != data_root_id or not facts.container.running:
            return None
        return facts

    def engine_token(self) -> EngineToken | None:
        """Taken before an engine-wide check (the image, the data root); None while nothing can be kept."""
        if not self._connection:
            return None
        return EngineToken(self._connection, self._generation, self._image_events)

    def engine_fact(self, key: str) -> Any | None:
        return self._engine_facts.get(key) if self._connection else None

    def put_engine_fact(self, token: EngineToken | None, key: str, value: Any) -> None:
        if token is not None and token == self.engine_token():
            self._engine_facts[key] = value

    async def engine_fact_or(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        """The kept fact ``key``, or ``fetch()``'s answer, kept unless an event raced it (a
        ``fetch`` that raises keeps nothing)."""
        if (known := self.engine_fact(key)) is not None:
            return known  # type: ignore[no-any-return]
        token = self.engine_token()
        value = await fetch()
        self.put_engine_fact(token, key, value)
        return value

    async def stopped_between(self, container_id: str, after_ns: int, before_ns: int, *, wait_s: float) -> bool:
        """The container stopped after ``after_ns`` and before ``before_ns`` (wall clock, ns), by
        the engine's own events. A stop the caller knows happened may not have been read yet: the
        answer waits for a stop after ``after_ns`` up to ``wait_s``, and is False without one."""
        with anyio.move_on_after(wait_s):
            while True:
                later = [t for t in self._stops.get(container_id, ()) if t > after_ns]
                if later:
                    return min(later) < before_ns
                await self._stopped.wait()
        return False

    def _note_stop(self, container_id: str, action: str, event: dict[str, Any]) -> None:
        when = event.get("timeNano")
        if not isinstance(when, int):
            return  # an engine that does not say when: no stop can be placed in time
        stops = self._stops.pop(container_id, [])
        if action == "die" or not stops:  # a destroy's processes stopped at its die, if one was seen
            stops.append(when)
        self._stops[container_id] = stops[-8:]
        while len(self._stops) > RECENT_STOPS:
            self._stops.popitem(last=False)
        self._stopped.set()
        self._stopped = anyio.Event()

    def _destroyed_since(self, token: Token, container_id: str) -> bool:
        """The container was destroyed after ``token`` was taken (or too many were to tell)."""
        since = self._destroyed - token.destroyed
        if since == 0:
            return False
        if since > len(self._recent):
            return True
        return container_id in list(self._recent)[-since:]

    def forget(self, container_id: str) -> None:
        self._container_gen[container_id] = self._container_gen.get(container_id, 0) + 1
        self._facts.pop(container_id, None)

    def destroyed(self, container_id: str) -> None:
        """The container is gone for good: nothing of it is kept but its id among the recent destroys."""
        self._container_gen.pop(container_id, None)
        self._facts.pop(container_id, None)
        self._recent.append(container_id)
        self._destroyed += 1

    def forget_all(self) -> None:
        self._generation += 1
        self._facts.clear()
        self._container_gen.clear()
        self._engine_facts.clear()

    # -- the engine side -------------------------------------------------------------------------

    def apply(self, event: dict[str, Any]) -> None:
        self.events_seen += 1
        kind = event.get("Type")
        action = str(event.get("Action") or event.get("status") or "").split(":", 1)[0]
        actor = (event.get("Actor") or {}).get("ID") or event.get("id") or ""
        if kind == "container":
            if action in ("die", "destroy"):
                self._note_stop(actor, action, event)
            if action == "destroy":
                self.destroyed(actor)
            elif action not in HARMLESS:
                self.forget(actor)
        elif kind == "image":
            self._image_events += 1
            self._engine_facts.clear()
            if action in ("delete", "untag"):
                self.forget_all()
        elif kind == "volume":
            if actor == DATA_ROOT_VOLUME:
                self.forget_all()
            elif action in VOLUME_GONE:
                for cid in [cid for cid, f in self._facts.items() if f.volume == actor]:
                    self.forget(cid)
        else:  # daemon (reload) or anything unknown
            self.forget_all()

    def _disconnected(self) -> None:
        self._connection = 0
        self.forget_all()

    async def follow(self) -> None:
        """Follow the engine's events for ever (cancelled with the supervisor's task group)."""
        follow = getattr(self.engine, "follow_events", None)
        if follow is None:
            return  # an engine without an event stream: every turn inspects
        delay = self.reconnect_s
        connections = 0
        while True:
            try:
                async with follow(EVENT_FILTERS) as events:
                    connections += 1
                    self.forget_all()  # nothing checked before this connection is kept
                    self._connection = connections
                    log.info("integrity.following", connection=connections)
                    delay = self.reconnect_s
                    async for event in events:
                        self.apply(event)
                log.warning("integrity.stream_ended")
            except Exception as exc:  # noqa: BLE001 - the engine may be down or restarting
                log.warning("integrity.stream_failed", error=repr(exc))
            finally:
                self._disconnected()
            await anyio.sleep(delay)
            delay = min(delay * 2, self.max_reconnect_s)
