"""The small variant of tests/bench/bench_store_commits.py: each arm's turns, on real stores
with their flusher processes, commit every job once with its receipt."""

from __future__ import annotations

from pathlib import Path

import pytest

from state.records import JobState
from state.store import Store
from tests.bench.bench_store_commits import RECEIPT, SynchronousCommits, one_round

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(("arm", "keeper_record"), [(SynchronousCommits, True), (Store, True), (Store, False)])
async def test_each_arms_turns_commit_their_receipts(tmp_path: Path, arm: type[Store], keeper_record: bool) -> None:
    store = arm(tmp_path / "s.db")
    await store.open()
    try:
        before_input: list[float] = []
        commit: list[float] = []
        rate = await one_round(store, "r0", chats=3, turns=2, cli_ms=1, loop_ms=0.5,
                               before_input=before_input, commit=commit, keeper_record=keeper_record)
        assert rate > 0 and (len(before_input), len(commit)) == (6, 6)
        for c in range(3):
            for t in range(2):
                job = await store.get_job("u", f"r0-{c}-{t}")
                assert job is not None and (job.state, job.receipt_json) == (JobState.DONE, RECEIPT % f"r0-{c}-{t}")
        assert store.flusher is not None and store.flusher.flushes >= 1
        assert len(await store.list_keepers("h")) == (3 if keeper_record else 0)  # one record per chat
    finally:
        store.close()
