"""source_identity: the exact commit and dirtiness of a real git tree, and the fallbacks."""

from __future__ import annotations

import subprocess
from pathlib import Path

from runner.attestation import SOURCE_ROOT, source_identity


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def repo(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    root.mkdir(parents=True)
    git(root, "init", "-q")
    (root / ".gitignore").write_text("ignored/\n")
    (root / "mod.py").write_text("x = 1\n")
    git(root, "add", ".")
    git(root, "-c", "user.email=t@example.invalid", "-c", "user.name=t", "commit", "-q", "-m", "one")
    return root


def test_a_clean_tree(tmp_path) -> None:
    root = repo(tmp_path)
    (root / "ignored").mkdir()
    (root / "ignored" / "cache.bin").write_text("ignored files do not make a tree dirty")
    ident = source_identity(root)
    assert (ident.sha, ident.dirty, ident.origin) == (git(root, "rev-parse", "HEAD"), False, "git")


def test_a_modified_tracked_file_is_dirty(tmp_path) -> None:
    root = repo(tmp_path)
    (root / "mod.py").write_text("x = 2\n")
    assert source_identity(root).dirty is True


def test_an_untracked_module_is_dirty(tmp_path) -> None:
    root = repo(tmp_path)
    (root / "new_module.py").write_text("y = 1\n")
    assert source_identity(root).dirty is True


def test_git_environment_cannot_point_at_another_tree(tmp_path, monkeypatch) -> None:
    root = repo(tmp_path)
    other = repo(tmp_path / "other")
    (other / "mod.py").write_text("changed\n")
    git(other, "-c", "user.email=t@example.invalid", "-c", "user.name=t", "commit", "-qam", "two")
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(other))
    ident = source_identity(root)
    monkeypatch.delenv("GIT_DIR")
    monkeypatch.delenv("GIT_WORK_TREE")
    assert ident.sha == git(root, "rev-parse", "HEAD") != git(other, "rev-parse", "HEAD")


def test_a_directory_inside_another_checkout_is_not_that_checkout(tmp_path) -> None:
    root = repo(tmp_path)
    inner = root / "vendored"
    inner.mkdir()
    ident = source_identity(inner)
    assert (ident.sha, ident.dirty, ident.origin) == (None, None, "unknown")


def test_source_sha_file_fallback_and_unknown(tmp_path) -> None:
    root = tmp_path / "installed"
    root.mkdir()
    assert (source_identity(root).sha, source_identity(root).origin) == (None, "unknown")
    (root / "SOURCE_SHA").write_text("0123456789abcdef0123456789abcdef01234567\n")
    ident = source_identity(root)
    assert (ident.sha, ident.dirty, ident.origin) == ("0123456789abcdef0123456789abcdef01234567", None,
                                                      "SOURCE_SHA file")


def test_this_checkout() -> None:
    ident = source_identity()
    # others commit to this checkout concurrently: the SHA must be a commit of it, on HEAD's line
    assert ident.origin == "git" and len(ident.sha) == 40
    git(SOURCE_ROOT, "merge-base", "--is-ancestor", ident.sha, "HEAD")
