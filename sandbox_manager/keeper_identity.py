"""What the keeper says about itself: its hello on every attach (and status query), the CLI's
exit, and the identity the store records of it — which a re-attach must find again."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sandbox_manager.keeper_errors import KeeperIdentityMismatch


class KeeperExit(BaseModel):
    model_config = ConfigDict(frozen=True)

    code: int | None = Field(description="exit code, when the CLI exited normally")
    signal: int | None = Field(description="the signal that ended it, otherwise")


class KeeperHello(BaseModel):
    """The keeper's hello on every attach (and status query)."""

    model_config = ConfigDict(frozen=True)

    protocol: int
    keeper_id: str = Field(description="random, made when the keeper started")
    keeper_pid: int
    pid: int = Field(description="the CLI's pid (= its process group) inside the sandbox")
    start_time: int = Field(description="the CLI's start time, field 22 of /proc/<pid>/stat (clock ticks)")
    member: str
    tags: dict[str, str] = Field(description="opaque tags given at start (member, locator, ...)")
    acked: int = Field(description="output offset acknowledged so far")
    written: int = Field(description="output bytes the CLI has written so far")
    eof_at: int | None = Field(description="offset where the CLI's stdout ended, if it did")
    exit: KeeperExit | None
    broken: bool
    broken_reason: str | None
    buffer_bytes: int
    input_received: int = Field(description="bytes of CLI input the keeper has received (whole frames)")
    input_written: int = Field(description="bytes of it written to the CLI's stdin")
    accepted: bool = Field(description="this connection is now the attached client")
    refused: str | None
    # absent from a keeper of an image before them: such a keeper is told its turns in the store
    turn_notes: bool = Field(default=False, description="the keeper keeps a turn note (frame T)")
    turn_note: str | None = Field(default=None, description="the last turn note the daemon wrote")


class KeeperIdentity(BaseModel):
    """What the store records of a keeper, and what a re-attach must find again."""

    model_config = ConfigDict(frozen=True)

    keeper_id: str
    pid: int
    start_time: int
    member: str
    tags: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def of(cls, hello: KeeperHello) -> KeeperIdentity:
        return cls(keeper_id=hello.keeper_id, pid=hello.pid, start_time=hello.start_time, member=hello.member,
                   tags=dict(hello.tags))

    def verify(self, hello: KeeperHello) -> None:
        for field in ("keeper_id", "pid", "start_time", "member", "tags"):
            if getattr(self, field) != getattr(hello, field):
                raise KeeperIdentityMismatch(field, getattr(self, field), getattr(hello, field))
