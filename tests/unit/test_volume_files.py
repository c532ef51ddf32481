"""A new state volume's root-owned file, written from the host (sandbox_manager.volume_files)."""

from __future__ import annotations

import os

import pytest

from sandbox_manager.volume_files import put_root_file

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the file is chowned to root: the daemon runs as root")


def test_the_file_is_written_root_owned_with_its_mode(tmp_path) -> None:
    os.chown(tmp_path, 1000, 1000)  # the image's home, copied into the volume, belongs to the agent
    assert put_root_file(str(tmp_path), "/home/agent/.marker", b'{"volume_id": "v1"}')
    st = os.stat(tmp_path / ".marker")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o444)
    assert (tmp_path / ".marker").read_bytes() == b'{"volume_id": "v1"}'


def test_an_existing_file_is_replaced_whole(tmp_path) -> None:
    (tmp_path / ".marker").write_bytes(b"a longer text that was there before")
    assert put_root_file(str(tmp_path), "/home/agent/.marker", b"new")
    assert (tmp_path / ".marker").read_bytes() == b"new"


def test_a_link_at_the_file_is_not_followed(tmp_path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"untouched")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".marker").symlink_to(target)
    assert not put_root_file(str(home), "/home/agent/.marker", b"new")
    assert target.read_bytes() == b"untouched"


def test_a_link_at_the_volume_is_not_followed(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert not put_root_file(str(tmp_path / "link"), "/home/agent/.marker", b"new")
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("mountpoint, path", [
    (None, "/home/agent/.marker"),  # the engine said nowhere
    ("/nonexistent-volume-dir", "/home/agent/.marker"),  # a remote engine's path
    ("TMP", "/home/agent/workspace/.marker"),  # only the volume's root
    ("TMP", "/etc/.marker"),  # not in the volume
    ("TMP", "/home/agent/.."),
])
def test_what_cannot_be_written_here_is_left_to_the_archive_api(tmp_path, mountpoint, path) -> None:
    mp = str(tmp_path) if mountpoint == "TMP" else mountpoint
    assert not put_root_file(mp, path, b"new")
    assert list(tmp_path.iterdir()) == []
