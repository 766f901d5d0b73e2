"""The one config-file watcher: a change is handed out at the first poll that sees it whole (read
twice, a settle delay apart, within that poll), never while a writer is at work, never empty; a
rejected file keeps the config in force and is handed out again until it changes; a missing file
keeps the config in force. The writer at work is the settle sleep itself (monkeypatched): a real
writer thread would make the test depend on scheduling."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_runtime.config import watch as configwatch
from kvfleet_runtime.config.fleet import check_successor, parse_fleet_config
from kvfleet_runtime.config.watch import ConfigFileWatcher


def test_a_change_is_handed_out_at_the_first_poll_that_sees_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    watcher = ConfigFileWatcher(path)
    assert [watcher.poll(), watcher.poll()] == [None, None]  # what it started from: applied
    path.write_text("a: 2\n")
    assert watcher.poll() == b"a: 2\n"  # this poll: no waiting for a second one
    watcher.accept(b"a: 2\n")
    assert (watcher.num_polls, watcher.applied_at_poll) == (3, 3)
    assert watcher.poll() is None  # and only once


def test_content_that_changes_between_the_two_reads_is_not_handed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    watcher = ConfigFileWatcher(path)
    writes = iter(["a: 3\nb:", "a: 3\nb: 4\n"])

    def writer_at_work(seconds: float) -> None:  # the settle sleep: the writer goes on
        assert seconds == configwatch.DEFAULT_SETTLE_S
        path.write_text(next(writes))

    monkeypatch.setattr(configwatch.time, "sleep", writer_at_work)
    path.write_text("a:")  # the write has begun
    assert watcher.poll() is None  # "a:" then "a: 3\nb:": still being written
    assert watcher.poll() is None  # "a: 3\nb:" then the whole file: still changed
    assert watcher.num_unsettled == 2
    monkeypatch.setattr(configwatch.time, "sleep", lambda seconds: None)
    assert watcher.poll() == b"a: 3\nb: 4\n"  # the writer is done: read the same twice


def test_an_empty_file_is_never_handed_out(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    watcher = ConfigFileWatcher(path)
    for empty in ("", "\n", "   \n\t"):  # truncated, about to be written: YAML says "defaults"
        path.write_text(empty)
        assert watcher.poll() is None
    path.write_text("a: 2\n")
    assert watcher.poll() == b"a: 2\n"


def test_a_rejected_file_stays_rejected_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("a: 1\n")
    watcher = ConfigFileWatcher(path)
    path.write_text("a: [unclosed\n")
    bad = watcher.poll()
    assert bad == b"a: [unclosed\n" and watcher.repeated is False
    watcher.reject(bad)
    again = watcher.poll()  # retried at the next poll ...
    assert again == bad and watcher.repeated is True  # ... and known to be reported already
    watcher.reject(again)
    assert watcher.applied_at_poll == 0  # the config in force is still the first one
    path.write_text("a: 1\n")  # back to what is in force: nothing to do
    assert watcher.poll() is None
    path.write_text("a: 5\n")
    assert watcher.poll() == b"a: 5\n" and watcher.repeated is False


def test_removal_keeps_the_config_and_a_return_applies_only_new_content(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    watcher = ConfigFileWatcher(path)  # absent at start
    assert watcher.poll() is None
    path.write_text("a: 1\n")
    content = watcher.poll()
    assert content == b"a: 1\n"
    watcher.accept(content)
    path.unlink()
    assert [watcher.poll(), watcher.poll()] == [None, None]  # the config in force stays
    path.write_text("a: 1\n")
    assert watcher.poll() is None  # back with what is in force
    path.unlink()
    path.write_text("a: 2\n")
    assert watcher.poll() == b"a: 2\n"


def test_the_settle_delay_must_not_be_negative(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="settle_s must be >= 0, got -1"):
        ConfigFileWatcher(tmp_path / "x", settle_s=-1)


def test_a_fleet_config_that_drops_the_generation_in_force_is_refused() -> None:
    current = parse_fleet_config('{"generation": 4, "tiers": {"t1_host": false}}')
    cut_short = parse_fleet_config("tiers:\n  t1_host: false\n")  # "generation: 4" was next
    with pytest.raises(ValueError, match=r"no `generation` .*has generation 4.* truncated"):
        check_successor(current, cut_short, "fleet.yaml")
    # Lower generations pass (a recreated policy starts again), and so does the first config.
    assert check_successor(current, parse_fleet_config('{"generation": 1}')).generation == 1
    assert check_successor(None, cut_short) is cut_short
    assert check_successor(parse_fleet_config("{}"), cut_short) is cut_short


# ---- bounded config text (issue 25) ----------------------------------------------------------

def test_config_text_is_bounded_in_size_depth_and_expanded_aliases() -> None:
    from kvfleet_runtime.config.watch import (
        MAX_CONFIG_BYTES,
        MAX_CONFIG_DEPTH,
        parse_config_text,
    )

    assert parse_config_text("a: 1\nb: [1, 2]", "f") == {"a": 1, "b": [1, 2]}
    assert parse_config_text("base: &b {x: 1}\nuse: *b", "f") == {"base": {"x": 1},
                                                                   "use": {"x": 1}}
    nested = "a: " + "[" * (MAX_CONFIG_DEPTH - 1) + "]" * (MAX_CONFIG_DEPTH - 1)
    assert parse_config_text(nested, "f") is not None
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n"
        for i in range(8))
    for text, why in [("a: " + "[" * 10_000, "nests deeper than 32 levels"),
                      (laughs, "expands to more than"),
                      ("x" * (MAX_CONFIG_BYTES + 1), "larger than"),
                      ("a: {b: 1", "not valid YAML/JSON at line 1")]:
        with pytest.raises(ValueError) as err:
            parse_config_text(text, "f.yaml")
        message = str(err.value)
        assert message.startswith("f.yaml: ") and why in message, message
        assert "\n" not in message and len(message) <= 500


def test_a_reverted_file_clears_the_rejection(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("a: 1\n")
    watcher = ConfigFileWatcher(path, settle_s=0)
    path.write_text("a: [\n")
    content = watcher.poll()
    assert content is not None
    watcher.reject(content, "c.yaml: not valid")
    assert watcher.error == "c.yaml: not valid"
    path.write_text("a: 1\n")
    assert watcher.poll() is None and watcher.error == ""


def test_json_text_is_read_by_json_within_the_same_bounds() -> None:
    import json as _json

    from kvfleet_runtime.config import watch as configwatch
    from kvfleet_runtime.config.watch import MAX_CONFIG_DEPTH, MAX_CONFIG_NODES, parse_config_text

    config = {"generation": 3, "replicas": [{"name": f"r{i}", "ready": True} for i in range(50)],
              "home_sets": {}, "t": 0.5, "s": "x: y"}
    text = _json.dumps(config, indent=2)
    assert parse_config_text(text, "f") == config == parse_config_text(text.encode(), "f")
    # The same data as the YAML reader gives for JSON text; NaN (not JSON) goes to YAML, as before.
    loader = configwatch._BoundedLoader(text)
    try:
        assert loader.get_single_data() == config
    finally:
        loader.dispose()
    assert parse_config_text('{"a": NaN}', "f") == {"a": "NaN"}
    assert parse_config_text("{a: 1}", "f") == {"a": 1}  # YAML flow style, not JSON
    ok = "[" * (MAX_CONFIG_DEPTH - 1) + "]" * (MAX_CONFIG_DEPTH - 1)
    assert parse_config_text('{"a": ' + ok + "}", "f") is not None
    wide = _json.dumps({"a": [0] * MAX_CONFIG_NODES})
    for text, why in [('{"a": ' + "[" * MAX_CONFIG_DEPTH + "]" * MAX_CONFIG_DEPTH + "}",
                       "nests deeper than 32 levels"),
                      ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper than 32"),
                      (wide, f"more than {MAX_CONFIG_NODES} nodes"),
                      ('{"a": 1', "not valid YAML/JSON at line 1")]:
        with pytest.raises(ValueError) as err:
            parse_config_text(text, "f.json")
        message = str(err.value)
        assert message.startswith("f.json: ") and why in message, message
        assert "\n" not in message and len(message) <= 500
