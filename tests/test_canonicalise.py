"""canonicalise: a fixed point, independent of row order, and it keeps the history."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from dagsync.canonical import content_hash
from dagsync.canonicalise import canonicalise
from dagsync.merge import merge
from dagsync.message import Message, TextPart
from dagsync.store import MessageStore, part_row
from tests.history import integrity, message_paths

CONTENTS = [Message(role, [TextPart(text)]) for role in ("system", "user") for text in ("a", "b")]

# A random tree with duplicates: row i hangs under the root or an earlier row.
trees = st.lists(
    st.tuples(st.integers(-1, 30), st.integers(0, len(CONTENTS) - 1)), min_size=1, max_size=30
).map(lambda rows: [(min(p, i - 1), c) for i, (p, c) in enumerate(rows)])


def build(path: Path, tree: list[tuple[int, int]], order: list[int]) -> None:
    """Write the tree's rows in ``order``, without the unique index, as an old file would."""
    ids = [f"01h{i:023d}" for i in range(len(tree))]
    with MessageStore.open(path) as store:
        store.conn.execute("DROP INDEX idx_messages_parent_hash_unique")
        conversation = store.start_conversation("c", "m")
        for i in order:
            parent, content = tree[i]
            message = CONTENTS[content]
            store.conn.execute(
                "INSERT INTO messages VALUES (?, ?, ?, ?, NULL, '2026-01-01T00:00:00Z')",
                (ids[i], "root" if parent < 0 else ids[parent], content_hash(message), message.role),
            )
            store.conn.execute(
                "INSERT INTO message_parts VALUES (?, ?, 0, ?, ?, ?, ?, ?)", (f"p{ids[i]}", ids[i], *part_row(message.parts[0]))
            )
        store.advance_conversation(conversation, ids[-1])


def dump(path: Path) -> list:
    with sqlite3.connect(path) as conn:
        return [
            conn.execute("SELECT id, parent_id, content_hash FROM messages ORDER BY id").fetchall(),
            conn.execute("SELECT id, message_id FROM message_parts ORDER BY id").fetchall(),
            conn.execute("SELECT head_message_id FROM conversations").fetchall(),
        ]


@given(trees, st.randoms())
def test_a_fixed_point_independent_of_row_order(tree, rng):
    with tempfile.TemporaryDirectory() as d:
        first, second = Path(d) / "a.db", Path(d) / "b.db"
        build(first, tree, list(range(len(tree))))
        order = list(range(len(tree)))
        rng.shuffle(order)
        # Rows must still arrive parents first for the file to be valid at all.
        order.sort(key=lambda i: _depth(tree, i))
        build(second, tree, order)
        paths_before = set(message_paths(first).values())
        report = canonicalise(first)
        canonicalise(second)
        assert dump(first) == dump(second)
        assert set(message_paths(first).values()) == paths_before
        assert integrity(first) == []
        again = canonicalise(first)
        assert (again.collapsed, again.groups) == (0, 0)
        with sqlite3.connect(first) as conn:
            dupes = conn.execute(
                "SELECT count(*) FROM (SELECT 1 FROM messages GROUP BY parent_id, content_hash HAVING count(*) > 1)"
            ).fetchone()[0]
        assert dupes == 0
        assert report.collapsed == len(tree) - len(paths_before)


@given(trees, st.randoms())
# Twins under the root, each with a child of the same content: the children are twins too.
@example([(-1, 0), (-1, 0), (0, 1), (1, 1), (3, 2), (2, 2)], None)
def test_a_merge_collapses_a_sources_twins_as_canonicalise_does(tree, rng):
    with tempfile.TemporaryDirectory() as d:
        source, canonical, target = Path(d) / "s.db", Path(d) / "c.db", Path(d) / "t.db"
        order = list(range(len(tree)))
        if rng is not None:
            rng.shuffle(order)
        order.sort(key=lambda i: _depth(tree, i))
        build(source, tree, order)
        build(canonical, tree, order)
        canonicalise(canonical)
        merge(target, [source])
        assert integrity(target) == []
        assert dump(target) == dump(canonical)
        assert set(message_paths(target).values()) == set(message_paths(source).values())


def _depth(tree, i):
    depth = 0
    while tree[i][0] >= 0:
        i, depth = tree[i][0], depth + 1
    return depth


def test_the_head_and_old_ids_follow_the_survivor(tmp_path):
    path = tmp_path / "d.db"
    build(path, [(-1, 0), (-1, 0), (1, 2)], [0, 1, 2])  # two copies of one system prompt
    report = canonicalise(path)
    assert (report.collapsed, report.conversations_rewritten, report.index_created) == (1, 0, True)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT parent_id FROM messages WHERE id = ?", (f"01h{2:023d}",)).fetchone() == (f"01h{0:023d}",)
        assert conn.execute("SELECT * FROM _dagsync_message_map").fetchall() == [(f"01h{1:023d}", f"01h{0:023d}")]


def test_a_dry_run_writes_nothing(tmp_path):
    path = tmp_path / "d.db"
    build(path, [(-1, 0), (-1, 0)], [0, 1])
    before = path.read_bytes()
    report = canonicalise(path, dry_run=True)
    assert (report.collapsed, report.dry_run) == (1, True)
    assert path.read_bytes() == before
