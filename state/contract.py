"""The store contract: what every store backend keeps (SPEC sections 8 and 16).

Two backends implement :class:`StoreContract`: SQLite (``state.store.Store``, the embedded
default) and PostgreSQL (``state.postgres.PostgresStore``, shared by a fleet). Both apply
the same migrations (``state.migrations``) and keep the same invariants:

* the job fence — a job id (scoped by user) is claimed once; a repeat sees the first
  one's state;
* the atomic commit rule — a member's durable locator changes only inside
  :meth:`StoreContract.finish_job`, in the transaction that records the job's receipt, and
  only for a :class:`VerifiedTurn`;
* the host fence — a store bound to a host lease (:meth:`StoreContract.bind_lease`) claims
  and commits only while that lease is live *in the same transaction*; the lease is judged
  by the store's clock (the database's, for PostgreSQL), never the host's;
* durability — a write returns committed and on durable storage, except one made with
  ``sync=False``: committed at once (seen by every later call, kept if the process dies),
  on durable storage once :meth:`StoreContract.sync` returns or a later synced commit is
  made. SQLite defers such a commit's flush; PostgreSQL syncs every commit anyway. A write
  may be seen by a concurrent call before it returns (SQLite's turn commit is flushed after
  its COMMIT): what is read is shown outside the process only after :meth:`sync`
  (runner.durable_responses).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, Protocol, runtime_checkable

from state.keepers import KeeperRecord
from state.sandbox_writes import SandboxWrites, SeenSandbox
from state.records import JobRecord, MemberRecord, PendingFork, SandboxRecord, SandboxState, SavedLocator
from state.wire_ledger import SettleQuery, WireExpectation, WireRecordRow, WireSettleView, WireTurnRow


def now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class VerifiedIn:
    """Where a member's native state was verified: the container, its image, the CLI's version
    (the member's ``last_*`` fields; a later turn elsewhere is a recreation or an upgrade, SPEC 15)."""

    container_id: str | None = None
    image_id: str | None = None
    cli_version: str | None = None


def fork_where(source: MemberRecord, where: VerifiedIn | None) -> tuple[str | None, str | None, str | None]:
    """A fork's native state was verified where the fork was made (``where``), else where its
    source's was (a lazy fork: nothing is made until its first turn)."""
    w = where or VerifiedIn(source.last_container_id, source.last_image_id, source.last_cli_version)
    return (w.container_id, w.image_id, w.cli_version)


@dataclass(frozen=True)
class VerifiedTurn:
    """A settled turn whose observed locator equalled the expected one (or a NEW one).

    Only this moves a member's durable locator.
    """

    locator: SavedLocator
    where: VerifiedIn | None = None  # None: where is not known (the member's last_* become NULL)


@dataclass(frozen=True)
class MemberOutcome:
    last_status: str
    last_outcome: str
    verified: VerifiedTurn | None = None  # None: failed / refused / not settled — locator untouched
    wire: WireTurnRow | None = None  # the turn's wire ledger row, committed with the receipt
    # the member's keeper between turns (SPEC 14: no turn in flight, output acknowledged up to the
    # turn's end), committed with the receipt rather than in a write of its own after it
    keeper: KeeperRecord | None = None


@dataclass(frozen=True)
class Claim:
    kind: Literal["claimed", "done", "running", "conflict"]
    job: JobRecord | None = None
    # ``read_member``: the job's member as the claim's transaction saw it (None: no record yet);
    # a "claimed" job's only
    member: MemberRecord | None = None
    # ``read_sandbox``: the chat's sandbox record as the same transaction saw it (a "claimed" job's only)
    sandbox: SeenSandbox | None = None


@dataclass(frozen=True)
class HostLease:
    """A host's registration: its fencing token is ``epoch`` (monotonic per host id)."""

    host_id: str
    epoch: int
    expires_ms: int  # store clock, milliseconds since the epoch


@dataclass(frozen=True)
class HostRecord:
    host_id: str
    api_url: str
    capacity: int
    epoch: int
    state: str  # live | fenced
    lease_until_ms: int
    live: bool  # state == live and the lease is unexpired, by the store's clock
    placed_chats: int  # chats placed on this epoch

    @property
    def free(self) -> int:
        return self.capacity - self.placed_chats


@dataclass(frozen=True)
class Placement:
    """Which host owns a chat: the host id *and* the epoch it had when the chat was placed."""

    user_id: str
    chat_id: str
    host_id: str
    host_epoch: int
    api_url: str
    live: bool  # the owner is still that epoch and its lease is live


@dataclass(frozen=True)
class ChatDeletion:
    """What one deletion of a chat's records did (``state.chat_deletion``)."""

    tombstoned: int  # receipts turned into tombstones by this deletion
    removed: int  # sandbox, member, ledger and placement rows removed by it


class Fenced(Exception):
    """The bound host lease is expired, fenced or superseded: nothing was written."""


class StoreUnavailable(Exception):
    """The store cannot be reached (e.g. PostgreSQL restarting): nothing was written."""


@runtime_checkable
class StoreContract(Protocol):
    """Every method runs off the event loop (worker thread or async driver)."""

    async def open(self) -> None: ...
    async def aclose(self) -> None: ...
    def close(self) -> None: ...
    async def sync(self) -> None: ...  # every commit made so far is on durable storage
    @property
    def schema_version(self) -> int: ...
    def bind_lease(self, lease: HostLease | None) -> None: ...

    # sandboxes
    sandbox_writes: SandboxWrites  # whether a claim's read of a sandbox record is still current
    async def get_sandbox(self, user_id: str, chat_id: str) -> SandboxRecord | None: ...
    async def put_sandbox(self, rec: SandboxRecord) -> None: ...
    async def set_sandbox_state(self, user_id: str, chat_id: str, state: SandboxState,
                                lost_reason: str | None = None) -> None: ...
    async def set_stop_reason(self, user_id: str, chat_id: str, reason: str | None) -> None: ...
    async def touch_sandbox(self, user_id: str, chat_id: str) -> None: ...
    async def list_sandboxes(self, state: SandboxState | None = None) -> list[SandboxRecord]: ...

    # members
    async def get_member(self, user_id: str, chat_id: str, member_id: str) -> MemberRecord | None: ...
    async def list_members(self, user_id: str, chat_id: str) -> list[MemberRecord]: ...
    async def ensure_member(self, user_id: str, chat_id: str, member_id: str, runtime: str, *,
                            locator: SavedLocator | None = None, settled_turns: int = 0,
                            forked_from: str | None = None) -> MemberRecord: ...
    async def create_fork_member(self, source: MemberRecord, member_id: str, *, home_member_id: str,
                                 locator: SavedLocator | None, settled_turns: int,
                                 pending: PendingFork | None, where: VerifiedIn | None = None) -> MemberRecord | None: ...
    async def mark_member_lost(self, user_id: str, chat_id: str, member_id: str, reason: str) -> None: ...

    # jobs
    async def claim_job(self, job_id: str, user_id: str, chat_id: str, member_id: str,
                        body_digest: str, owner: str, *, sync: bool = True, read_member: bool = False,
                        read_sandbox: bool = False) -> Claim: ...
    async def get_job(self, user_id: str, job_id: str) -> JobRecord | None: ...
    async def finish_job(self, user_id: str, job_id: str, receipt_json: str, member: MemberOutcome | None) -> None: ...
    # finish_job, its receipt decided in the same transaction from the ledger view of its verdict
    async def settle_job(self, user_id: str, job_id: str, query: SettleQuery,
                         decide: Callable[[WireSettleView], tuple[str, MemberOutcome | None]], *,
                         sync: bool = True) -> None: ...
    async def close_orphaned_job(self, user_id: str, job_id: str, receipt_json: str) -> bool: ...
    async def running_jobs(self, *, not_owner: str | None = None, host_id: str | None = None) -> list[JobRecord]: ...
    async def recent_receipts(self, user_id: str, chat_id: str, limit: int = 10) -> list[str]: ...

    # hosts and placement (a fleet; a lone SQLite host may use them too)
    async def register_host(self, host_id: str, api_url: str, capacity: int, ttl_s: float) -> HostLease: ...
    async def renew_lease(self, lease: HostLease, ttl_s: float) -> HostLease | None: ...
    async def list_hosts(self) -> list[HostRecord]: ...
    async def place_chat(self, user_id: str, chat_id: str) -> Placement | None: ...
    async def get_placement(self, user_id: str, chat_id: str) -> Placement | None: ...

    # the wire ledger (SPEC 12; state.wire_ledger)
    async def put_wire_record(self, row: WireRecordRow) -> bool:
        """Store ``row``; False (nothing stored) for a difference whose parent the chat's
        ledger does not hold."""
        ...

    async def wire_records_of_job(self, user_id: str, chat_id: str, job_id: str) -> list[WireRecordRow]: ...

    async def wire_ancestors(self, user_id: str, chat_id: str, seeds: list[str], *, stop: Collection[str] = (),
                             limit: int) -> list[WireRecordRow]:
        """The records ``seeds`` lead back to through digest_parent, the seeds included, never
        past a record in ``stop`` (nor one of them), at most ``limit`` records, in one read:
        nearest first, each seed's chain in turn from the seed back (to where it joins an earlier
        one). A record the chat's ledger does not hold ends its chain."""
        ...

    async def wire_expectation(self, user_id: str, chat_id: str, member_id: str) -> WireExpectation: ...
    async def wire_settle_view(self, user_id: str, job_id: str, query: SettleQuery) -> WireSettleView: ...
    async def wire_baseline_at(self, user_id: str, chat_id: str, member_id: str, settled_index: int) -> str | None: ...
    async def purge_wire_capture(self, before: datetime) -> int: ...
    async def delete_wire_chat(self, user_id: str, chat_id: str) -> None: ...

    # deleting a chat (state.chat_deletion): records gone, receipts kept as tombstones
    async def chat_known(self, user_id: str, chat_id: str) -> bool: ...
    async def delete_chat(self, user_id: str, chat_id: str) -> ChatDeletion: ...
    # keepers (SPEC 14; state.keepers)
    async def put_keeper(self, rec: KeeperRecord, *, sync: bool = True) -> None: ...
    async def list_keepers(self, host_id: str) -> list[KeeperRecord]: ...
    async def delete_keeper(self, user_id: str, chat_id: str, member_id: str) -> None: ...
