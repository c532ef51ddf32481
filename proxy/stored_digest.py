"""A record's digest as the ledger stores it: its difference from an earlier record (issue 16).

A request carries its member's whole history, so a record holding its whole digest made the
wire ledger grow with the square of a chat's turns: ~95 bytes a message in every request's
record and again in every turn's baseline, 16.7 MiB after 300 Pi turns of one member. A
conversational request nearly always extends its member's previous one, so the sink stores
it as that record's id (``digest_parent``), how many of that record's entries it starts with
(``digest_shared``) and only the entries after them (``digest``). A turn's baseline is stored
as its record's id and its reply (:class:`BaselineRef`), not as the whole conversation again.

Every :data:`KEYFRAME_DEPTH`-th record of a chain is stored whole, so rebuilding a digest reads
at most that many records; a whole record is also stored when the request shares nothing with
the previous one (a compaction, a proxy that restarted and knows no previous record).

:func:`rebuild` gives readers records whose ``digest`` is whole again; nothing outside the
ledger's writer and its readers ever sees a difference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, Field

from .records import DigestEntry, WireRecord, common_prefix

KEYFRAME_DEPTH = 32  # a chain's records between two whole ones, at most


class BaselineRef(BaseModel):
    """A turn's baseline as stored: the record whose whole digest is its conversation, and
    that turn's reply (empty after a failure)."""

    record_id: str = Field(description="the wire record of the turn's last conversational request")
    reply: list[DigestEntry] = Field(default_factory=list)


def shared_prefix(parent: Sequence[DigestEntry], digest: Sequence[DigestEntry]) -> int:
    """How many leading entries ``digest`` has in common with ``parent``."""
    return common_prefix(parent, digest)


def as_difference(record: WireRecord, parent_id: str, parent_digest: Sequence[DigestEntry]) -> WireRecord | None:
    """``record`` stored as its difference from the record ``parent_id`` (whose whole digest is
    ``parent_digest``); None when it shares no entry with it (then it is stored whole)."""
    digest = record.digest or []
    shared = shared_prefix(parent_digest, digest)
    if shared == 0:
        return None
    return record.model_copy(update={"digest": list(digest[shared:]), "digest_parent": parent_id,
                                     "digest_shared": shared})


def rebuild(records: Mapping[str, WireRecord], known: Mapping[str, list[DigestEntry]]) -> dict[str, WireRecord]:
    """``records`` (by record id, as stored) with their whole digests. A difference's parent is
    looked for in ``records``, then in ``known`` (record id -> that record's whole digest). A
    record whose chain is broken gets no digest, as an unreadable request does."""
    # digests are never changed once made, so the known ones are shared, not copied: a long
    # chat's is hundreds of entries, on every turn
    whole: dict[str, list[DigestEntry] | None] = dict(known)

    def digest_of(rid: str) -> list[DigestEntry] | None:
        chain: list[str] = []  # from rid back to the first record whose whole digest is known
        at: str | None = rid
        while at is not None and at not in whole:
            record = records.get(at)
            if record is None or at in chain:  # missing, or a loop (never written so)
                break
            chain.append(at)
            at = record.digest_parent
        base = whole.get(at) if at is not None else None
        for link in reversed(chain):
            record = records[link]
            if record.digest_parent is None:
                base = list(record.digest) if record.digest is not None else None
            elif base is None or record.digest is None or record.digest_shared is None:
                base = None
            else:
                base = [*base[:record.digest_shared], *record.digest]
            whole[link] = base
        return whole.get(rid)

    out: dict[str, WireRecord] = {}
    for rid, record in records.items():
        if record.digest_parent is None:
            out[rid] = record
            continue
        digest = digest_of(rid)
        if digest is None:
            out[rid] = record.model_copy(update={
                "digest": None, "digest_parent": None, "digest_shared": None,
                "digest_error": f"the stored digest's parent record {record.digest_parent} is missing"})
        else:
            out[rid] = record.model_copy(update={"digest": digest, "digest_parent": None, "digest_shared": None})
    return out
