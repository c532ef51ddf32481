"""The throughput bench's account of CPU a turn (tests/bench/bench_supervisor.py): the way to
the CLI in each arm, small processes included, against what a ratio of 0.90 allows."""

from __future__ import annotations

from tests.bench.bench_supervisor import (
    FORKS,
    WAY_KEY,
    cpu_per_turn,
    table_order,
    way_line,
)


def test_the_way_to_the_cli_counts_its_small_processes_and_nothing_else() -> None:
    before = {"all": 1.0, "python bench_supervisor.py": 0.5, "pi": 0.2, FORKS: 10.0}
    after = {"all": 1.2, "python bench_supervisor.py": 0.55, "pi": 0.27, "python wal_flush_child.py": 0.002,
             "dockerd (children)": 0.001, "python deploy.loopback": 0.01, FORKS: 12.0}
    got = cpu_per_turn(before, after, 10)
    # 5 ms of the daemon's process, 0.2 of the flusher and 0.1 of dockerd's waited-for children: not the CLI's 7
    assert round(got[WAY_KEY], 6) == 5.3
    assert "python wal_flush_child.py" not in got and got[FORKS] == 0.2  # under 0.5 ms a turn: no row of its own
    assert [k for k in got if k != WAY_KEY] == ["all", "pi", "python bench_supervisor.py", "python deploy.loopback",
                                                FORKS]


def test_the_line_says_what_the_ratio_is_made_of() -> None:
    d = {"all": 18.0, WAY_KEY: 9.0}
    b = {"all": 13.5, WAY_KEY: 5.0}
    assert way_line("pi", d, b) == (
        "pi: CPU ms a turn under the throughput run, the way to the CLI (daemon, keeper, client, proxy service, "
        "WAL flusher | this process's driver, dockerd, containerd, the shim): 9.0 | 5.0, the supervisor's share "
        "+4.0; everything else (the CLI, the fixture) 9.0 | 8.5; 0.90 of the bare arm's turns a second allows "
        "15.0 ms a turn, 1.5 over its 13.5")


def test_the_table_puts_this_processs_threads_under_it() -> None:
    by = {"all": 20.0, "pi": 7.0, "python bench_supervisor.py": 5.0, "  its loop thread": 4.0,
          "  its other threads": 1.0, "  this process's garbage collector": 0.1, "python deploy.loopback": 1.4}
    assert table_order(list(reversed(by)), by) == [
        "all", "pi", "python bench_supervisor.py", "  its loop thread", "  its other threads",
        "  this process's garbage collector", "python deploy.loopback"]
