"""A resident's turn checked from facts the engine's events had not yet spoiled (issue 16, SPEC 15).

A LIVE turn trusts the integrity facts the engine's event stream keeps fresh. An event that
has not reached the daemon yet — the container removed or stopped just before the turn — is
not in them, and the turn writes its message to a CLI that is already gone: its link ends
before any output. Such a turn asks the engine again before it settles for ``not_settled``:

* the sandbox is lost (its volume gone or changed): the turn is the LOST refusal, as if the
  events had come first (the CLI said nothing, so the model was sent nothing through it);
* the container stopped *before the turn wrote its message*, by the time of the engine's own
  ``die`` event against the turn's clock: its CLI never read the message, and the turn runs
  again from its preparation — on the recreated or restarted container, RESTORED (or NEW)
  through the CLI's own resume handshake, as if the events had come first;
* otherwise (the container ran on, or stopped after the message was written and the CLI may
  have read it) the turn's own ``not_settled`` stands: running the message again could put it
  twice into the CLI's history.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from runner.residents import ResidentPool
from runner.turn_context import Refusal, TurnContext
from sandbox_manager.chat_containers import ImageRefused
from sandbox_manager.disk_bound import SandboxRefused
from sandbox_manager.identity import SandboxLost
from sandbox_manager.sandbox import Sandbox
from sandbox_manager.sandboxes import SandboxManager
from sandbox_manager.sealing import ModelGateNotReady

# How long the turn waits for the engine's event of a stop it knows happened (the container was
# recreated or restarted under it): the engine published it before the call that removed or
# stopped the container returned, so it is on its way (milliseconds); a stream that is down
# sends nothing, and the turn's not_settled stands.
STOP_EVENT_WAIT_S = 2.0


class RunAgain(Exception):
    """The turn's CLI was gone before it wrote the message: run the turn again from its
    preparation (which now checks against the engine)."""

    def __init__(self, container_id: str) -> None:
        super().__init__(f"container {container_id[:12]} stopped before the turn's message was written")
        self.container_id = container_id


Resolve = Callable[[str, str], Awaitable[Sandbox]]


async def recheck(ctx: TurnContext, key: tuple[str, str, str], *, resident_made_ns: int | None, resolve: Resolve,
                  manager: SandboxManager, pool: ResidentPool) -> Refusal | None:
    """The turn's LOST refusal, None (its own outcome stands), or RunAgain raised. ``ctx.sandbox``
    is then the chat's sandbox as the engine has it now (or None after RunAgain).
    ``resident_made_ns``: when the turn's resident was made (None: it was retired under the
    turn, and no stop can be placed against it)."""
    job = ctx.job
    old = ctx.sandbox
    assert old is not None
    manager.release(old)  # our use goes first: a replacement the check makes waits for its uses
    ctx.sandbox = None
    try:
        ctx.sandbox = await resolve(job.user_id, job.chat_id)  # released with the turn
    except SandboxLost as lost:
        await pool.retire_where(lambda r: r.key[:2] == key[:2], "sandbox lost")
        return Refusal(lost.reason.value, detail=lost.detail)
    except (ImageRefused, ModelGateNotReady, SandboxRefused):
        return None  # not lost: the turn's own outcome stands
    now = ctx.sandbox
    if resident_made_ns is None:
        return None
    started = now.container.started_ns
    if (now.container_id == old.container_id and not (now.started or now.created or now.replaced)
            and started is not None and started < resident_made_ns):
        return None  # it ran all along: the CLI itself ended
    if ctx.input_ns is None or not await manager.integrity.stopped_between(
            old.container_id, resident_made_ns, ctx.input_ns, wait_s=STOP_EVENT_WAIT_S):
        return None
    await pool.retire(key, "its container stopped before the turn")
    manager.release(now)
    ctx.sandbox = None
    raise RunAgain(old.container_id)
