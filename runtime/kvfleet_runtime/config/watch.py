"""The one config-file watcher of the replica, the router and the fleet tier.

A process calls `ConfigFileWatcher.poll()` once per poll interval (on a worker thread: a poll
that sees new content sleeps a few milliseconds). A change applies at the first poll that sees
it, and only whole files are applied:

    content = watcher.poll()         # new settled content, or None
    if content is not None:
        try:
            config = parse(content)  # the bytes the watcher read, never the file again
        except ValueError:
            watcher.reject(content)  # the last good config stays in force
        else:
            apply(config)
            watcher.accept(content)

Why a half-written file is never applied (decided for issue 18, where a toggle used to wait one
more poll for the file to hold still):

- The settle re-read. On new content the watcher waits `settle_s` and reads the file again, in
  the same poll; other bytes mean a writer is at work, so nothing applies this poll and the next
  poll looks again. An editor or `kubectl cp` truncates and then writes within milliseconds; a
  ConfigMap volume swaps a symlink, which is atomic (the re-read only confirms it).
- An empty (or whitespace-only) file is never handed out. That is what a file looks like between
  its truncation and its write, and it parses as valid YAML with every default (all tiers back to
  their defaults): it keeps the config in force, like a missing or unreadable file.
- A file that does not parse is rejected by the caller and keeps the last good config. It is
  handed out again at every poll until it changes (`repeated` then says the caller already
  reported it), so a writer that stalled past the settle delay is picked up once it finishes.
- The fleet config's readers also refuse a config without a `generation` after one that had one
  (`config.fleet.check_successor`): the operator always writes it, so its absence means a
  hand-written file cut short where it still parses. Generations are not required to grow: a
  recreated policy starts again from 1.

Config text is input like a request body, and bounded like one (`parse_config_text`, the one
YAML/JSON reader of the replica config, the fleet config and the router's view of it): at most
`MAX_CONFIG_BYTES` (a ConfigMap's own limit: 1 MiB), `MAX_CONFIG_DEPTH` levels of nesting (deeper
made PyYAML recurse until `RecursionError`, which killed the watcher), at most `MAX_CONFIG_ALIASES`
aliases and `MAX_CONFIG_NODES` nodes once aliases are expanded (a "billion laughs" file of nested
anchors is a few hundred bytes that expand to 10**9 nodes). Every refusal is a one-line
ValueError naming the source and where; callers parse on a worker thread, never on the event loop.

A missing file keeps the config in force (a ConfigMap update never removes the file: a missing
one is a mistake or a rename in progress); when it returns, it applies if its content differs
from what is in force. `num_polls` and `applied_at_poll` count polls, so that "applied within one
poll" can be checked without clocks (the fleet tier reports both in its load report).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DEFAULT_SETTLE_S",
    "MAX_CONFIG_ALIASES",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
    "ConfigFileWatcher",
    "one_line_error",
    "parse_config_text",
    "read_fingerprint",
]

MAX_CONFIG_BYTES = 1 << 20
"""A ConfigMap holds at most 1 MiB; a larger file is refused unread past this."""
MAX_CONFIG_DEPTH = 32
"""The deepest real config nests 4 levels (`replicas[i].url`)."""
MAX_CONFIG_ALIASES = 1000
MAX_CONFIG_NODES = 200_000
"""Nodes with every alias expanded: a 1,000-replica fleet config is ~10,000."""
MAX_ERROR_CHARS = 500
"""Longest config error message (logged and shown in /readyz)."""

DEFAULT_SETTLE_S = 0.02
"""The settle delay: long against a truncate-then-write (microseconds to a few ms), short
against a poll interval (seconds)."""


def read_fingerprint(path: Path) -> bytes | None:
    """The file's bytes (at most `MAX_CONFIG_BYTES` + 1: a larger file is refused by the parser
    without being read whole), or None when it cannot be read."""
    try:
        with path.open("rb") as f:
            return f.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None


def one_line_error(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """A config error as one line of at most `limit` characters."""
    flat = " ".join(text[: 4 * limit].split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with nesting, alias and expanded-size bounds, checked while the
    document is composed (before anything is constructed)."""

    def __init__(self, stream: str | bytes) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_CONFIG_ALIASES:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise _Bounded(f"more than {MAX_CONFIG_ALIASES} aliases (line {mark.line + 1})")
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_CONFIG_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise _Bounded(f"nests deeper than {MAX_CONFIG_DEPTH} levels "
                               f"(line {mark.line + 1}, column {mark.column + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Bounded(Exception):
    pass


def _expanded_nodes(root: yaml.Node) -> int:
    """Nodes of `root` with every alias expanded (a shared node counts at each use); depth is
    bounded already, so recursion is safe, and memoized so the count itself is linear."""
    memo: dict[int, int] = {}

    def count(node: yaml.Node) -> int:
        known = memo.get(id(node))
        if known is not None:
            return known
        n = 1
        if isinstance(node, yaml.SequenceNode):
            n += sum(count(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            n += sum(count(k) + count(v) for k, v in node.value)
        memo[id(node)] = n
        return n

    return count(root)


def _no_constant(name: str) -> Any:
    # NaN and Infinity are not JSON: refused, then read by the YAML reader (to a string) as before.
    raise ValueError(name)


def _json_within_bounds(data: Any, source: str) -> Any:
    """`data` (parsed JSON: no aliases) if it nests at most `MAX_CONFIG_DEPTH` levels and has at
    most `MAX_CONFIG_NODES` nodes, counted without recursion; ValueError otherwise."""
    nodes = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if depth > MAX_CONFIG_DEPTH:
            raise ValueError(f"{source}: refused: nests deeper than {MAX_CONFIG_DEPTH} levels")
        if nodes > MAX_CONFIG_NODES:
            raise ValueError(f"{source}: refused: more than {MAX_CONFIG_NODES} nodes")
        if isinstance(value, dict):
            nodes += len(value)  # the keys
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return data


def parse_config_text(content: bytes | str, source: str) -> Any:
    """YAML (or JSON) config text -> Python data (None for an empty document), within the
    bounds above; ValueError, one line naming `source` and where, otherwise.

    Text that is a JSON object (what the operator writes) is read by the json module, within the
    same bounds: PyYAML's pure-Python loader took ~2 s of a reader's CPU for a 1,000-replica fleet
    config (200 KB), which every router and replica parses at every change; json takes ~ms. Text
    that is not valid JSON is read as YAML, as before."""
    size = len(content)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{source}: larger than {MAX_CONFIG_BYTES} bytes")
    if content.lstrip()[:1] in (b"{", "{"):
        try:
            data = json.loads(content, parse_constant=_no_constant)
        except RecursionError:
            raise ValueError(f"{source}: refused: nests deeper than {MAX_CONFIG_DEPTH} "
                             f"levels") from None
        except ValueError:  # not JSON (YAML flow style, or broken): the YAML reader says where
            pass
        else:
            return _json_within_bounds(data, source)
    loader: _BoundedLoader | None = None
    try:
        # Inside the try: PyYAML's reader decodes and checks the whole text when the loader is
        # made, and raises its ReaderError there for a control byte (`\x07`) or bytes that are
        # not UTF-8; outside, that error escaped every caller and killed the watcher task.
        loader = _BoundedLoader(content)
        root = loader.get_single_node()
        if root is None:
            return None
        nodes = _expanded_nodes(root)
        if nodes > MAX_CONFIG_NODES:
            raise _Bounded(f"expands to more than {MAX_CONFIG_NODES} nodes through its aliases "
                           f"({nodes})")
        return loader.construct_document(root)
    except _Bounded as exc:
        raise ValueError(f"{source}: refused: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(one_line_error(
            f"{source}: not valid YAML/JSON{where}: {exc.problem or exc.context}")) from None
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(one_line_error(f"{source}: not valid YAML/JSON: {exc}")) from None
    finally:
        if loader is not None:
            loader.dispose()


@dataclass(slots=True)
class ConfigFileWatcher:
    """Apply-at-first-sight change detection for one file. Construct it BEFORE the first load:
    the content it starts from is what the process is assumed to have applied, so a write between
    the two is seen as a change and loaded again (harmless), never missed."""

    path: Path
    settle_s: float = DEFAULT_SETTLE_S
    num_polls: int = field(init=False, default=0)
    """Polls so far."""
    applied_at_poll: int = field(init=False, default=0)
    """The poll whose content was last accepted (0: the content the watcher started from)."""
    num_unsettled: int = field(init=False, default=0)
    """Polls that saw the file change between their two reads (a write in progress)."""
    repeated: bool = field(init=False, default=False)
    """The content `poll` just returned was rejected before: the caller has reported it."""
    error: str = field(init=False, default="")
    """Why the file's content is not in force ("" when it is): the last `reject`'s reason, for
    the readiness probes."""
    _applied: bytes | None = field(init=False)
    _rejected: bytes | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s!r}")
        self._applied = read_fingerprint(self.path)

    def poll(self) -> bytes | None:
        """One poll: the file's content when it differs from the applied one, is not empty and
        read the same twice `settle_s` apart; else None. Blocks for `settle_s` when the file
        changed, so async callers run it with `asyncio.to_thread`."""
        self.num_polls += 1
        now = read_fingerprint(self.path)
        if now == self._applied:
            self.error = ""  # the file is back to what is in force
            return None
        if now is None or not now.strip():
            return None
        if self.settle_s:
            time.sleep(self.settle_s)
        if read_fingerprint(self.path) != now:
            self.num_unsettled += 1
            return None
        self.repeated = now == self._rejected
        return now

    def accept(self, content: bytes) -> None:
        """`content` (from `poll`) parsed and is now in force."""
        self._applied = content
        self._rejected = None
        self.error = ""
        self.applied_at_poll = self.num_polls

    def reject(self, content: bytes, reason: str = "") -> None:
        """`content` (from `poll`) did not parse (`reason`: why, one line): the config in force
        stays; polls hand it out again until the file changes."""
        self._rejected = content
        self.error = one_line_error(reason) if reason else "rejected"
