"""The bounded writable-layer scan behind the measured disk limit."""

from __future__ import annotations

import os

from sandbox_manager.disk_usage import scan, scan_all

MiB = 1024 * 1024


def test_allocated_bytes_are_counted_once_and_the_scan_stops_at_the_limit(tmp_path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "data").write_bytes(os.urandom(3 * MiB))
    os.link(tmp_path / "a" / "b" / "data", tmp_path / "a" / "hardlink")  # the same blocks again
    with open(tmp_path / "sparse", "wb") as fh:  # 1 GiB apparent, almost nothing allocated
        fh.truncate(1024 * MiB)
    os.symlink("/", tmp_path / "root-link")  # never followed
    usage = scan(str(tmp_path), 10 * MiB)
    assert not usage.over and 3 * MiB <= usage.bytes < 4 * MiB and usage.entries == 6
    over = scan(str(tmp_path), 2 * MiB)
    assert over.over and over.why == "over 2 MiB" and over.bytes > 2 * MiB


def test_too_many_files_count_as_over_and_end_the_scan(tmp_path) -> None:
    for i in range(50):
        (tmp_path / f"f{i}").write_bytes(b"")
    usage = scan(str(tmp_path), 10 * MiB, max_entries=20)
    assert (usage.over, usage.entries, usage.why) == (True, 21, "more than 20 files")
    assert not scan(str(tmp_path), 10 * MiB, max_entries=100).over


def test_a_missing_layer_is_empty(tmp_path) -> None:
    usage = scan(str(tmp_path / "gone"), MiB)
    assert (usage.bytes, usage.entries, usage.over) == (0, 0, False)


def test_a_layer_and_a_state_volume_share_one_bound(tmp_path) -> None:
    layer, volume = tmp_path / "upper", tmp_path / "volume"
    layer.mkdir()
    volume.mkdir()
    (layer / "a").write_bytes(os.urandom(2 * MiB))
    (volume / "b").write_bytes(os.urandom(2 * MiB))
    both = scan_all([str(layer), str(volume)], 5 * MiB)
    assert not both.over and 4 * MiB <= both.bytes < 5 * MiB and both.entries == 2
    over = scan_all([str(layer), str(volume)], 3 * MiB)  # each under it, the sum over
    assert (over.over, over.why) == (True, "over 3 MiB") and over.bytes > 3 * MiB
    many = scan_all([str(layer), str(volume)], 5 * MiB, max_entries=1)
    assert (many.over, many.why) == (True, "more than 1 files")
