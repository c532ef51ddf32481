"""The throughput bench's scheduler trace (tests/bench/sched_trace.py): idle CPU time charged to
what ran beside it, per arm's window, from perf's sched_switch lines."""

from __future__ import annotations

from tests.bench.sched_trace import (
    NOTHING,
    IdleShare,
    Switch,
    attribute,
    parse,
    preemption_report,
    preemptions,
    report,
)

LINES = """\
 7921/7921  [001]   147.035541000: prev_comm=rm prev_pid=7921 prev_prio=120 prev_state=D ==> next_comm=kworker/1:1H next_pid=47 next_prio=100
   47/47    [001]   147.035577000: prev_comm=kworker/1:1H prev_pid=47 prev_prio=100 prev_state=I ==> next_comm=perf next_pid=7922 next_prio=120
    0/0     [000]   147.035600000: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=node next_pid=8001 next_prio=120
 junk that is not a switch
"""


def test_perf_script_lines_become_switches() -> None:
    assert list(parse(LINES.splitlines())) == [
        Switch(147.035541, 1, 7921, 7921, 47),
        Switch(147.035577, 1, 47, 47, 7922),
        Switch(147.0356, 0, 0, 0, 8001, preempted=True),  # the idle task is always "runnable"
    ]


def group(tid: int, pid: int) -> str:
    return {100: "daemon loop", 101: "daemon store", 200: "cli"}.get(tid, f"pid {pid}")


def test_idle_time_is_charged_to_what_ran_beside_it_within_each_window() -> None:
    switches = [
        Switch(0.0, 0, 9, 9, 100),  # cpu0: the daemon's loop from 0
        Switch(0.0, 1, 9, 9, 200),  # cpu1: the CLI from 0
        Switch(1.0, 1, 200, 50, 0),  # cpu1 idles from 1 (the CLI is process 50)
        Switch(3.0, 0, 100, 10, 101),  # cpu0: the store thread from 3
        Switch(4.0, 0, 101, 10, 0),  # cpu0 idles from 4: both idle
        Switch(5.0, 1, 0, 0, 200),  # cpu1: the CLI again from 5
        Switch(6.0, 0, 0, 0, 100),
        Switch(8.0, 0, 100, 10, 0),  # after the windows: not counted
    ]
    got = attribute(switches, [("d", 0.5, 4.5), ("b", 4.5, 7.0)], 2, group)
    d, b = got["d"], got["b"]
    assert d.seconds == 4.0 and b.seconds == 2.5
    # d: cpu1 idle 1..4.5 (3.5 s): the loop ran beside it 1..3, the store thread 3..4, nothing 4..4.5 (both)
    assert d.by_group == {"daemon loop": 2.0, "daemon store": 1.0, NOTHING: 1.0}
    assert d.idle == 4.0
    # b: 4.5..5 both idle, 5..6 cpu0 idle beside the CLI, 6..7 none idle
    assert b.by_group == {NOTHING: 1.0, "cli": 1.0}
    assert b.idle == 2.0


def test_a_cpu_not_yet_seen_leaves_the_time_uncounted() -> None:
    switches = [Switch(0.0, 0, 9, 9, 0), Switch(2.0, 1, 9, 9, 100), Switch(3.0, 0, 0, 0, 100),
                Switch(4.0, 0, 100, 10, 0)]
    got = attribute(switches, [("d", 0.0, 5.0)], 2, group)
    # 0..2 cpu1 unknown: nothing counted; 2..3 cpu0 idle beside the loop; 3..4 both busy; after the
    # last switch the trace says nothing
    assert got["d"].seconds == 2.0 and got["d"].by_group == {"daemon loop": 1.0}


def test_the_report_puts_the_arms_side_by_side_per_turn() -> None:
    d = IdleShare(seconds=10, idle=0.03, by_group={"this process: its loop thread": 0.02, NOTHING: 0.01})
    b = IdleShare(seconds=10, idle=0.01, by_group={NOTHING: 0.01})
    lines = report({"d": d, "b": b}, {"d": 10, "b": 20}, top=1)
    assert lines == [
        "idle CPU ms a turn, by what ran meanwhile (perf sched_switch):",
        f"  {'':44s}    daemon      bare",
        f"  {'idle, all of it':44s}      3.00      0.50",
        f"  {'this process: its loop thread':44s}      2.00      0.00",
        f"  {'the rest':44s}      1.00      0.50",
    ]


def test_the_loops_preemptions_are_counted_by_what_came_in_with_the_wait_after_them() -> None:
    switches = [
        Switch(1.0, 0, 100, 10, 200, preempted=True),  # the loop (tid 100) preempted by the CLI
        Switch(1.5, 0, 200, 50, 100),  # back after 0.5 s
        Switch(2.0, 0, 100, 10, 101, preempted=True),  # by its store thread
        Switch(2.1, 1, 7, 7, 100),  # back on the other core after 0.1 s
        Switch(3.0, 1, 100, 10, 0),  # asleep: not a preemption
        Switch(5.0, 1, 0, 0, 100),
        Switch(6.0, 1, 100, 10, 200, preempted=True),  # in the bare window
        Switch(6.2, 1, 200, 50, 100),
    ]
    got = preemptions(switches, [("d", 0.0, 4.0), ("b", 4.0, 8.0)], 100, group)
    assert got["d"].count == 2 and got["d"].by_group == {"cli": 1, "daemon store": 1}
    assert abs(got["d"].waited - 0.6) < 1e-9  # 0.5 s after the first, 0.1 after the second
    assert got["b"].count == 1 and abs(got["b"].waited - 0.2) < 1e-9 and got["b"].by_group == {"cli": 1}
    assert preemption_report(got, {"d": 2, "b": 1}) == [
        "the loop thread, daemon arm: preempted 1.0 times a turn, then off a core 300.00 ms a turn; by cli 0.50, "
        "daemon store 0.50",
        "the loop thread, bare arm: preempted 1.0 times a turn, then off a core 200.00 ms a turn; by cli 1.00",
    ]
