"""The one config-file watcher: a change is reported once the file has held still for one poll."""

from __future__ import annotations

from pathlib import Path

from kvfleet_runtime.configwatch import ConfigFileWatcher


def test_a_change_is_reported_on_the_poll_after_it_settles(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    watcher = ConfigFileWatcher(path)
    assert [watcher.poll(), watcher.poll()] == [False, False]  # what it started from: applied
    path.write_text("a: 2\n")
    assert watcher.poll() is False  # seen once: it may be half-written
    assert watcher.poll() is True  # unchanged for one poll: apply it
    assert watcher.poll() is False  # and only once


def test_a_file_still_being_written_is_never_reported(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    watcher = ConfigFileWatcher(path)
    seen = []
    for partial in ("", "a:", "a: 3", "a: 3\nb:", "a: 3\nb: 4\n"):
        path.write_text(partial)
        seen.append(watcher.poll())
    assert seen == [False] * 5
    assert watcher.poll() is True  # the last content, settled


def test_a_change_that_reverts_before_settling_is_not_reported(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    watcher = ConfigFileWatcher(path)
    path.write_text("")  # truncated ...
    assert watcher.poll() is False
    path.write_text("a: 1\n")  # ... and rewritten with the same content
    assert [watcher.poll(), watcher.poll()] == [False, False]


def test_removal_and_return_are_changes(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    watcher = ConfigFileWatcher(path)  # absent at start
    path.write_text("a: 1\n")
    assert [watcher.poll(), watcher.poll()] == [False, True]
    path.unlink()
    assert [watcher.poll(), watcher.poll()] == [False, True]
