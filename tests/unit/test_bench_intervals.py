"""The bench's bootstrap intervals: LIVE added (a difference) and the RESTORED ratio."""

from __future__ import annotations

import statistics

import pytest

from tests.bench.bench_supervisor import added_interval, ratio_interval, restored_cells


def test_pairs_in_one_ratio_give_that_ratio_as_the_whole_interval() -> None:
    assert ratio_interval([330.0, 110.0, 220.0], [300.0, 100.0, 200.0]) == pytest.approx((1.1, 1.1))


def test_the_ratio_interval_holds_the_runs_ratio_and_is_as_wide_as_its_pairs_disagree() -> None:
    rest_d = [300.0, 320.0, 290.0, 360.0, 310.0]
    rest_b = [290.0, 300.0, 300.0, 310.0, 295.0]
    lo, hi = ratio_interval(rest_d, rest_b)
    assert lo < statistics.median(rest_d) / statistics.median(rest_b) < hi
    # the median's ratio can only come from medians of values the pairs hold
    assert min(rest_d) / max(rest_b) <= lo and hi <= max(rest_d) / min(rest_b)
    assert ratio_interval(rest_d, rest_b) == (lo, hi)  # seeded: the same run prints the same interval


def test_the_added_interval_is_a_difference_of_medians() -> None:
    assert added_interval([12.0, 15.0, 13.0], [10.0, 13.0, 11.0]) == pytest.approx((2.0, 2.0))


def test_a_run_without_restored_pairs_prints_dashes_for_them() -> None:
    """``--restored 0`` (the LIVE figures alone) printed nothing: a median of no pairs raised."""
    assert restored_cells({"rest_d": [], "rest_b": []}).split() == ["-", "-", "-"]
    assert restored_cells({"rest_d": [330.0, 110.0, 220.0], "rest_b": [300.0, 100.0, 200.0]}).split() == \
        ["220", "200", "1.100"]
