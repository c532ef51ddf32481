"""A turn's commit fsynced on the store's thread against one flushed by the flusher process,
and the keeper's turn record in the store against in the keeper's note, side by side in one
run (issue 16, stops 51 and 52).

    uv run python tests/bench/bench_store_commits.py [--chats 16] [--turns 40] [--rounds 4]

Each arm is a real SQLite store with its flusher process, in a directory of its own. ``C``
chats run their turns at once, each turn the store calls a LIVE turn makes, in the order
the daemon makes them: the job's claim (relaxed, its flush asked for at once), then beside
each other the wait for that flush and the keeper's turn record (relaxed), the CLI's turn
(a sleep: the CLI is another process), the daemon's own work on its loop (a busy wait, as it
holds the GIL the store's thread needs), and the turn's commit (``settle_job``). The arms
differ only in that commit:

* ``synchronous``: the COMMIT fsyncs on the store's thread (``synchronous=FULL``), as until
  this stop;
* ``flushed``: a relaxed COMMIT, the flush asked of the flusher at once, and the turn waits
  for it afterwards (``state.store.Store.settle_job`` with ``sync=False`` now, then the wait
  its response makes, runner.durable_responses).
* ``noted``: as ``flushed``, with the keeper's turn record in the keeper's own note (stop 52,
  runner.keepers: a frame on the keeper's socket, no store write) instead of the store: what
  a turn does now. The two ``flushed`` arms differ only in that store write.

Rounds alternate the arms' order. Printed: turns per second and their ratios, and per turn the
time before the CLI's input (claim, its flush and the keeper record) and the commit, p50 and p90.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from runner.alongside import alongside
from state.keepers import KeeperRecord, KeeperTurn
from state.store import Store, now
from state.wire_ledger import SettleQuery, sqlite_settle_view

RECEIPT = '{"job_id": "%s", "outcome": "succeeded"}'


class SynchronousCommits(Store):
    """The store as it committed a turn until stop 51: the fsync on its own thread."""

    async def settle_job(self, user_id, job_id, query, decide, *, sync=True) -> None:  # type: ignore[no-untyped-def]
        def q(db):  # type: ignore[no-untyped-def]
            job = self._running_job(db, user_id, job_id)
            receipt_json, member = decide(sqlite_settle_view(db, user_id, job_id, query))
            self._finish(db, job, receipt_json, member)

        try:
            await self._run(lambda db: self._tx(db, q))
        finally:
            self.sandbox_writes.wrote(user_id, query.chat_id)


def keeper(chat: str, job_id: str) -> KeeperRecord:
    turn = KeeperTurn(job_json='{"job_id": "%s"}' % job_id, start_json='{"turn": 2}', offset=40,
                      context_status="LIVE", started_at=now(), timings_json='{"sandbox": 1, "process": 2}')
    return KeeperRecord(user_id="u", chat_id=chat, member_id="m1", host_id="h", runtime="pi", container_id="cid",
                        run_dir="/home/agent/members/m1/run",
                        identity={"keeper_id": "k" * 32, "pid": 7, "start_time": 99, "member": "m1", "tags": {}},
                        session={"turns": 1}, acked=40, turn=turn)


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


async def one_round(store: Store, tag: str, chats: int, turns: int, cli_ms: float, loop_ms: float,
                    before_input: list[float], commit: list[float], *, keeper_record: bool = True) -> float:
    async def chat(c: int) -> None:
        name = f"c{c}"
        for t in range(turns):
            job = f"{tag}-{c}-{t}"
            t0 = time.perf_counter()
            claim = await store.claim_job(job, "u", name, "m1", "d", "o", sync=False)
            assert claim.kind == "claimed"
            if keeper_record:
                await alongside(store.sync, lambda: store.put_keeper(keeper(name, job), sync=False))
            else:
                await store.sync()  # the keeper's note is a frame on its socket: no store call
            before_input.append((time.perf_counter() - t0) * 1000)
            await anyio.sleep(cli_ms / 1000)
            busy(loop_ms)
            t1 = time.perf_counter()
            # as the turn commits and its response then waits (runner.durable_responses)
            await store.settle_job("u", job, SettleQuery(name, None), lambda view, j=job: (RECEIPT % j, None),
                                   sync=False)
            await store.sync()
            commit.append((time.perf_counter() - t1) * 1000)

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for c in range(chats):
            tg.start_soon(chat, c)
    return chats * turns / (time.perf_counter() - t)


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))]


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"synchronous": SynchronousCommits(Path(tmp) / "sync" / "s.db"),
                "flushed": Store(Path(tmp) / "flushed" / "s.db"),
                "noted": Store(Path(tmp) / "noted" / "s.db")}
        for store in arms.values():
            await store.open()
        rate: dict[str, list[float]] = {a: [] for a in arms}
        before_input: dict[str, list[float]] = {a: [] for a in arms}
        commit: dict[str, list[float]] = {a: [] for a in arms}
        try:
            for r in range(args.rounds):
                order = list(arms) if r % 2 == 0 else list(reversed(arms))
                for arm in order:
                    rate[arm].append(await one_round(arms[arm], f"r{r}", args.chats, args.turns, args.cli_ms,
                                                     args.loop_ms, before_input[arm], commit[arm],
                                                     keeper_record=arm != "noted"))
        finally:
            for store in arms.values():
                store.close()
    print(f"{args.chats} chats x {args.turns} turns x {args.rounds} rounds per arm, alternated; the CLI's turn "
          f"{args.cli_ms} ms, the daemon's loop work {args.loop_ms} ms a turn")
    print(f"{'arm':12} {'turns/s':>8} {'before input p50':>17} {'p90':>6} {'commit p50':>11} {'p90':>6}")
    for arm in arms:
        print(f"{arm:12} {statistics.median(rate[arm]):8.1f} {pct(before_input[arm], .5):17.2f} "
              f"{pct(before_input[arm], .9):6.2f} {pct(commit[arm], .5):11.2f} {pct(commit[arm], .9):6.2f}")
    for a, b in (("flushed", "synchronous"), ("noted", "flushed")):
        ratio = statistics.median(rate[a]) / statistics.median(rate[b])
        print(f"turns/s {a} / {b}: {ratio:.3f} (per round: "
              + ", ".join(f"{x / y:.3f}" for x, y in zip(rate[a], rate[b], strict=True)) + ")")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cli-ms", type=float, default=20.0)
    ap.add_argument("--loop-ms", type=float, default=2.0)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = ap.parse_args()
    anyio.run(main, args, backend="asyncio", backend_options={"use_uvloop": args.loop == "uvloop"})
